//! The live-migration test's guest that never lets pre-copy converge
//! (runs at CPL3, natively): it rewrites 32 MiB of RAM pass after pass,
//! each word `pass * WORDS + index`, and checks before each write that
//! the word holds what the pass before wrote. A migration that lost a
//! dirty page shows as a mismatch. Prints a line every 100 passes and,
//! at the end, how many words differed; exits 0 only when none did.
#![no_std]
#![no_main]

use guest_rt::{println, Env};

const BYTES: usize = 32 << 20;
const WORDS: usize = BYTES / 8;
const PASSES: u64 = 3000;

#[no_mangle]
fn guest_main(env: &mut Env) -> u32 {
    let Ok(buf) = env.dma.alloc(BYTES, 4096) else {
        println!("no memory for the buffer");
        return 1;
    };
    let words = buf.virt.cast::<u64>();
    let mut bad = 0u64;
    for pass in 0..PASSES {
        let base = pass * WORDS as u64;
        for i in 0..WORDS {
            // SAFETY: `buf` is `BYTES` bytes of identity-mapped RAM this
            // guest owns alone (allocated above, never given to a device),
            // 4 KiB aligned, so word `i < WORDS` lies inside it.
            unsafe {
                let w = words.add(i);
                if pass > 0 && core::ptr::read_volatile(w) != base - WORDS as u64 + i as u64 {
                    bad += 1;
                }
                core::ptr::write_volatile(w, base + i as u64);
            }
        }
        if pass % 100 == 0 {
            println!("pass {pass}: bad={bad}");
        }
    }
    println!("dirty-ram: passes={PASSES} bad={bad}");
    u32::from(bad != 0)
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    guest_rt::on_panic(info)
}
