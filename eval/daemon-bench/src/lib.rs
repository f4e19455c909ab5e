//! Benchmarks of the board daemon's management plane, as binaries of
//! their own so that the daemon crate ships none (`docs/benchmarks.md`):
//! `control-bench` (control requests against a daemon with many
//! instances) and `attack-bench` (control and metrics latency while
//! hostile clients attack the daemon).
