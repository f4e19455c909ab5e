//! The harnesses the fuzz targets in `fuzz/` run (`docs/fuzzing.md`),
//! kept out of the production crates: each drives only what those crates
//! export, as a guest or a client would.
//!
//! - [`drive_ring`]: the vNPU device core from guest-controlled bytes
//!   (register writes, ring set-up, mailbox commands, guest memory).
//! - [`serve_stream`]: the board daemon's vfio-user server on one
//!   connection's byte stream.
//! - [`run_session`]: whole hostile vfio-user sessions against a served
//!   instance, then an honest client.
//! - [`drive_dma`]: a client's DMA table under any map, unmap and file
//!   growth sequence.
//! - [`resume_from`]: a device core resuming from a session folder whose
//!   files hold anything.
//! - [`take_stream`]: a device core taking a device stream a migrating
//!   client wrote.
//! - [`take_pieces`]: a device core taking a live migration's pre-copy
//!   pieces and its incremental stream.
//!
//! Each is also run by this crate's tests on fixed inputs, so the
//! harnesses stay built and working on stable Rust.

mod dma;
mod resume;
mod ring;
mod server;
mod session;
mod stream;

pub use dma::drive_dma;
pub use resume::resume_from;
pub use ring::drive_ring;
pub use server::serve_stream;
pub use session::run_session;
pub use stream::{take_pieces, take_stream};
