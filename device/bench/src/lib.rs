//! Shared helpers of the benchmark binaries.

use std::time::Instant;

/// Runs `f` once to warm up, then `runs` times; returns the median seconds.
pub fn median_seconds(runs: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..runs.max(1))
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// Deterministic values in [-1, 1).
pub fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Times the closures in alternating blocks (A A A, B B B, C C C, then
/// again), each block after one untimed warm-up call; returns each one's
/// median seconds. Blocks, with a pause before each, keep threads that
/// spin after a call (OpenBLAS, rayon) from stealing the next
/// measurement's cores; alternating them
/// twice keeps a ratio honest when the machine's speed drifts.
pub fn interleaved_medians(runs: usize, fs: &mut [&mut dyn FnMut()]) -> Vec<f64> {
    let per_block = runs.div_ceil(2).max(1);
    let mut t = vec![Vec::with_capacity(2 * per_block); fs.len()];
    for _ in 0..2 {
        for (i, f) in fs.iter_mut().enumerate() {
            // Let the previous contender's spinning worker threads go idle.
            std::thread::sleep(std::time::Duration::from_millis(300));
            f();
            for _ in 0..per_block {
                let s = Instant::now();
                f();
                t[i].push(s.elapsed().as_secs_f64());
            }
        }
    }
    t.into_iter()
        .map(|mut v| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        })
        .collect()
}
