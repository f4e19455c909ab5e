//! The PC's CMOS real-time clock at ports 0x70 (index) and 0x71 (data),
//! as much of it as an OS reads: the host's current UTC time in BCD,
//! 24-hour mode, no update in progress, valid RAM; other registers read 0
//! and writes are ignored. Without it a Linux guest's `rtc_cmos` driver
//! waits seconds for a clock that never answers.

use std::time::{SystemTime, UNIX_EPOCH};

/// Index port.
pub const CMOS_INDEX: u16 = 0x70;
/// Data port.
pub const CMOS_DATA: u16 = 0x71;

/// The clock's register file: the selected index only.
#[derive(Debug, Default)]
pub struct Cmos {
    index: u8,
}

impl Cmos {
    /// The selected index (for a snapshot).
    pub fn index(&self) -> u8 {
        self.index
    }

    /// A clock whose selected index is `index` (a restored snapshot's).
    pub fn with_index(index: u8) -> Self {
        Self { index }
    }
}

fn bcd(v: u64) -> u8 {
    let v = (v % 100) as u8;
    ((v / 10) << 4) | (v % 10)
}

/// (year, month, day, weekday 1..=7 from Sunday, hour, minute, second) of
/// `secs` seconds after the Unix epoch, in UTC (proleptic Gregorian).
fn civil(secs: u64) -> (u64, u64, u64, u64, u64, u64, u64) {
    let days = secs / 86_400;
    let rem = secs % 86_400;
    // Howard Hinnant's days-to-civil algorithm, for days >= 0.
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    // 1970-01-01 was a Thursday (weekday 5 counting Sunday as 1).
    let weekday = (days + 4) % 7 + 1;
    (year, month, day, weekday, rem / 3600, rem / 60 % 60, rem % 60)
}

impl Cmos {
    /// A port write.
    pub fn write(&mut self, port: u16, v: u8) {
        if port == CMOS_INDEX {
            // Bit 7 is the NMI mask, not part of the index.
            self.index = v & 0x7f;
        }
    }

    /// A port read.
    pub fn read(&self, port: u16) -> u8 {
        if port != CMOS_DATA {
            return 0xff;
        }
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        self.register(now)
    }

    fn register(&self, now: u64) -> u8 {
        let (year, month, day, weekday, hour, minute, second) = civil(now);
        match self.index {
            0x00 => bcd(second),
            0x02 => bcd(minute),
            0x04 => bcd(hour),
            0x06 => bcd(weekday),
            0x07 => bcd(day),
            0x08 => bcd(month),
            0x09 => bcd(year),
            // Status A: no update in progress, 32.768 kHz base, 1024 Hz.
            0x0a => 0x26,
            // Status B: 24-hour mode, BCD, no interrupts enabled.
            0x0b => 0x02,
            // Status D: RAM and time valid.
            0x0d => 0x80,
            // Century (the register Linux reads when no ACPI table names one).
            0x32 => bcd(year / 100),
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates_are_right() {
        assert_eq!(civil(0), (1970, 1, 1, 5, 0, 0, 0));
        // 2000-02-29 12:34:56 UTC, a Tuesday.
        assert_eq!(civil(951_827_696), (2000, 2, 29, 3, 12, 34, 56));
        // 2026-11-21 00:00:00 UTC, a Saturday.
        assert_eq!(civil(1_795_219_200), (2026, 11, 21, 7, 0, 0, 0));
    }

    #[test]
    fn registers_read_bcd_time_and_status() {
        let mut c = Cmos::default();
        c.write(CMOS_INDEX, 0x80 | 0x09);
        assert_eq!(c.register(951_827_696), 0x00);
        c.write(CMOS_INDEX, 0x32);
        assert_eq!(c.register(951_827_696), 0x20);
        c.write(CMOS_INDEX, 0x04);
        assert_eq!(c.register(951_827_696), 0x12);
        c.write(CMOS_INDEX, 0x0b);
        assert_eq!(c.register(0), 0x02);
        assert_eq!(c.read(CMOS_INDEX), 0xff);
    }
}
