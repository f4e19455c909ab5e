//! Placing vNPU cores on physical cores: every vNPU core needs a physical
//! core with room for its SAs, VUs and SRAM, and its chip's HBM pool room
//! for its HBM. Among the cores that fit, the choice fills EUs as far as
//! they go (best fit on execution units) and, between equally good cores,
//! keeps EU use and memory use of the core balanced, so many-EU /
//! small-memory vNPUs end up beside few-EU / large-memory ones.

use npu_model::BoardConfig;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use vnpu_spec::Shape;

/// Why a vNPU does not fit.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PlacementError {
    #[error("a vNPU core needs {sa} SAs, {vu} VUs, {sram} B SRAM; a physical core has {board_sa} SAs, {board_vu} VUs, {board_sram} B")]
    NeverFits { sa: u32, vu: u32, sram: u64, board_sa: u32, board_vu: u32, board_sram: u64 },
    #[error("{chips} vNPU chips wanted, the board has {board_chips}")]
    TooManyChips { chips: u32, board_chips: u32 },
    #[error(
        "no room: the board's free execution units or memory cannot take this vNPU (stop another one first)"
    )]
    NoRoom,
    #[error(
        "physical core {core} has no room for {sa} SAs + {vu} VUs + {sram} B SRAM beside its other vNPUs"
    )]
    NoRoomOnCore { core: u32, sa: u32, vu: u32, sram: u64 },
    #[error("a remap keeps the vNPU's cores: {from} -> {to} cores per chip or chips (stop and start it to change them)")]
    CoreCountChange { from: u32, to: u32 },
}

/// How [`Board::place_scored`] chooses among the cores where a one-core
/// vNPU fits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Fill execution units (best fit), then balance EU against memory use:
    /// [`Board::place`].
    #[default]
    Pack,
    /// As `pack` first; among the cores that pack equally well, the one
    /// where the predicted interference is least.
    Interference,
    /// The least predicted interference first; packing breaks ties.
    InterferenceFirst,
}

impl Policy {
    pub const ALL: [Policy; 3] = [Policy::Pack, Policy::Interference, Policy::InterferenceFirst];

    pub fn name(self) -> &'static str {
        match self {
            Policy::Pack => "pack",
            Policy::Interference => "interference",
            Policy::InterferenceFirst => "interference-first",
        }
    }
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Policy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown placement policy `{s}` (pack, interference, interference-first)"))
    }
}

/// An interference cost as an ordered key: overheads closer than 1e-4
/// (0.01% of a solo run) are a tie; a cost that could not be computed
/// (NaN) comes last.
fn cost_key(cost: f64) -> i64 {
    if cost.is_nan() {
        i64::MAX
    } else {
        (cost * 1e4).round().clamp(i64::MIN as f64, (i64::MAX - 1) as f64) as i64
    }
}

/// What is in use on one physical core.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CoreLoad {
    pub sa: u32,
    pub vu: u32,
    pub sram: u64,
}

/// The physical board's capacity and current use.
#[derive(Clone, Debug)]
pub struct Board {
    pub chips: u32,
    pub cores_per_chip: u32,
    pub sa: u32,
    pub vu: u32,
    pub sram: u64,
    /// HBM per chip.
    pub hbm: u64,
    pub cores: Vec<CoreLoad>,
    /// HBM in use per chip.
    pub hbm_used: Vec<u64>,
}

/// Where the cores of one vNPU went.
pub type Placement = Vec<u32>;

impl Board {
    /// An empty board of `cfg`.
    pub fn new(cfg: &BoardConfig) -> Self {
        let n = (cfg.chips * cfg.cores_per_chip) as usize;
        Self {
            chips: cfg.chips,
            cores_per_chip: cfg.cores_per_chip,
            sa: cfg.core.sa_count,
            vu: cfg.core.vu_count,
            sram: cfg.sram_bytes(),
            hbm: cfg.hbm_bytes_per_chip(),
            cores: vec![CoreLoad::default(); n],
            hbm_used: vec![0; cfg.chips as usize],
        }
    }

    /// Whether a core of shape `s` fits on physical core `core`.
    pub fn fits(&self, core: usize, s: &Shape) -> bool {
        let c = &self.cores[core];
        let chip = core / self.cores_per_chip as usize;
        c.sa + s.sa_per_core() <= self.sa
            && c.vu + s.vu_per_core() <= self.vu
            && c.sram + s.sram_per_core() <= self.sram
            && self.hbm_used[chip] + s.hbm_per_core() <= self.hbm
    }

    /// Lower is better: EUs left free on the core after placing `s` (fill
    /// cores up), then the gap between its EU and memory fill (balance).
    pub fn score(&self, core: usize, s: &Shape) -> (u32, u64) {
        let c = &self.cores[core];
        let (sa, vu, sram) = (c.sa + s.sa_per_core(), c.vu + s.vu_per_core(), c.sram + s.sram_per_core());
        let eu_left = self.sa + self.vu - sa - vu;
        let eu_fill = f64::from(sa + vu) / f64::from(self.sa + self.vu);
        let mem_fill = sram as f64 / self.sram as f64;
        (eu_left, ((eu_fill - mem_fill).abs() * 1e6) as u64)
    }

    /// Takes `cores` for a vNPU of shape `s`.
    pub fn occupy(&mut self, s: &Shape, cores: &[u32]) {
        for &c in cores {
            let (i, chip) = (c as usize, (c / self.cores_per_chip) as usize);
            if let Some(l) = self.cores.get_mut(i) {
                l.sa += s.sa_per_core();
                l.vu += s.vu_per_core();
                l.sram += s.sram_per_core();
            }
            if let Some(h) = self.hbm_used.get_mut(chip) {
                *h += s.hbm_per_core();
            }
        }
    }

    /// Gives back what a vNPU of shape `s` on `cores` took.
    pub fn release(&mut self, s: &Shape, cores: &[u32]) {
        for &c in cores {
            let (i, chip) = (c as usize, (c / self.cores_per_chip) as usize);
            if let Some(l) = self.cores.get_mut(i) {
                l.sa = l.sa.saturating_sub(s.sa_per_core());
                l.vu = l.vu.saturating_sub(s.vu_per_core());
                l.sram = l.sram.saturating_sub(s.sram_per_core());
            }
            if let Some(h) = self.hbm_used.get_mut(chip) {
                *h = h.saturating_sub(s.hbm_per_core());
            }
        }
    }

    /// Remaps a vNPU of shape `from` on `cores` to shape `to` on the same
    /// cores (a workload change: its HBM data stays where it is), within
    /// each core's free EUs and memory (or, with `Some(factor)`, up to
    /// `factor` times the core's SAs and VUs). On error nothing changes.
    pub fn remap(
        &mut self,
        from: &Shape,
        to: &Shape,
        cores: &[u32],
        oversubscribe: Option<u32>,
    ) -> Result<(), PlacementError> {
        if (from.chips(), from.cores_per_chip()) != (to.chips(), to.cores_per_chip()) {
            return Err(PlacementError::CoreCountChange {
                from: from.chips() * from.cores_per_chip(),
                to: to.chips() * to.cores_per_chip(),
            });
        }
        let mut trial = self.clone();
        trial.release(from, cores);
        let f = oversubscribe.unwrap_or(1).max(1);
        for &c in cores {
            let i = c as usize;
            let chip = i / self.cores_per_chip as usize;
            let Some(l) = trial.cores.get(i) else { return Err(PlacementError::NoRoom) };
            let ok = l.sa + to.sa_per_core() <= self.sa * f
                && l.vu + to.vu_per_core() <= self.vu * f
                && l.sram + to.sram_per_core() <= self.sram
                && trial.hbm_used.get(chip).is_some_and(|h| h + to.hbm_per_core() <= self.hbm);
            if !ok {
                return Err(PlacementError::NoRoomOnCore {
                    core: c,
                    sa: to.sa_per_core(),
                    vu: to.vu_per_core(),
                    sram: to.sram_per_core(),
                });
            }
            trial.occupy(to, &[c]);
        }
        *self = trial;
        Ok(())
    }

    /// Places a vNPU of shape `s`: each vNPU chip on a distinct physical
    /// chip, each of its cores on a distinct core of that chip, each the
    /// best-scoring core left ([`Board::score`]), the chip whose cores
    /// score best in total.
    pub fn place(&mut self, s: &Shape) -> Result<Placement, PlacementError> {
        self.check(s)?;
        let pick = |t: &Board, _: &[u32], fitting: &[u32]| {
            fitting.iter().copied().min_by_key(|&c| t.score(c as usize, s))
        };
        self.place_chip_by_chip(s, pick, |_, _, total| total)
    }

    /// The errors of a shape no placement can fit: cores larger than a
    /// physical core, more chips or cores per chip than the board has.
    fn check(&self, s: &Shape) -> Result<(), PlacementError> {
        if s.sa_per_core() > self.sa || s.vu_per_core() > self.vu || s.sram_per_core() > self.sram {
            return Err(PlacementError::NeverFits {
                sa: s.sa_per_core(),
                vu: s.vu_per_core(),
                sram: s.sram_per_core(),
                board_sa: self.sa,
                board_vu: self.vu,
                board_sram: self.sram,
            });
        }
        if s.chips() > self.chips || s.cores_per_chip() > self.cores_per_chip {
            return Err(PlacementError::TooManyChips { chips: s.chips(), board_chips: self.chips });
        }
        Ok(())
    }

    /// Places `s` chip by chip: for each vNPU chip, every physical chip
    /// not used yet is filled one core at a time with `pick(board, cores,
    /// fitting)`'s choice among the chip's cores where one more fits
    /// (`board`: with the cores chosen so far taken; `cores`: the vNPU's
    /// cores so far, on earlier chips and this one), and the chip whose
    /// `key(board, cores, total)` is least is taken (`total`: the summed
    /// [`Board::score`] of its cores as they were picked; the first of
    /// equal chips). On error nothing changes.
    fn place_chip_by_chip<K, P, F>(
        &mut self,
        s: &Shape,
        mut pick: P,
        mut key: F,
    ) -> Result<Placement, PlacementError>
    where
        K: Ord,
        P: FnMut(&Board, &[u32], &[u32]) -> Option<u32>,
        F: FnMut(&Board, &[u32], (u32, u64)) -> K,
    {
        let mut trial = self.clone();
        let mut placed: Vec<u32> = Vec::new();
        let mut used_chips: Vec<u32> = Vec::new();
        for _ in 0..s.chips() {
            let mut best: Option<(Vec<u32>, K)> = None;
            for chip in (0..self.chips).filter(|c| !used_chips.contains(c)) {
                let mut t = trial.clone();
                let mut with = placed.clone();
                let mut total = (0u32, 0u64);
                let base = chip * self.cores_per_chip;
                for _ in 0..s.cores_per_chip() {
                    let fitting: Vec<u32> = (base..base + self.cores_per_chip)
                        .filter(|c| !with.contains(c) && t.fits(*c as usize, s))
                        .collect();
                    let Some(c) = pick(&t, &with, &fitting) else { break };
                    let sc = t.score(c as usize, s);
                    total = (total.0 + sc.0, total.1 + sc.1);
                    t.occupy(s, &[c]);
                    with.push(c);
                }
                if with.len() - placed.len() != s.cores_per_chip() as usize {
                    continue;
                }
                let k = key(&t, &with, total);
                if best.as_ref().is_none_or(|b| k < b.1) {
                    best = Some((with.split_off(placed.len()), k));
                }
            }
            let (cores, _) = best.ok_or(PlacementError::NoRoom)?;
            used_chips.push(cores[0] / self.cores_per_chip);
            trial.occupy(s, &cores);
            placed.extend(cores);
        }
        *self = trial;
        Ok(placed)
    }

    /// Places a one-core vNPU of shape `s` even when no core has free EUs
    /// left (oversubscription): on the core, among those with room for its
    /// SRAM and HBM (memory is never oversubscribed), whose engines are
    /// least oversubscribed afterwards, up to `max_factor` times the core's
    /// SAs and VUs. The vNPUs of such a core time-share it.
    pub fn place_oversubscribed(&mut self, s: &Shape, max_factor: u32) -> Result<Placement, PlacementError> {
        if let Ok(p) = self.place(s) {
            return Ok(p);
        }
        if s.chips() != 1 || s.cores_per_chip() != 1 {
            return Err(PlacementError::NoRoom);
        }
        let (cap_sa, cap_vu) = (self.sa * max_factor.max(1), self.vu * max_factor.max(1));
        let best = (0..self.cores.len())
            .filter(|&c| {
                let l = &self.cores[c];
                let chip = c / self.cores_per_chip as usize;
                l.sram + s.sram_per_core() <= self.sram
                    && self.hbm_used[chip] + s.hbm_per_core() <= self.hbm
                    && l.sa + s.sa_per_core() <= cap_sa
                    && l.vu + s.vu_per_core() <= cap_vu
            })
            .min_by_key(|&c| {
                let l = &self.cores[c];
                let over = |used: u32, cap: u32| u64::from(used) * 1000 / u64::from(cap.max(1));
                over(l.sa + s.sa_per_core(), self.sa).max(over(l.vu + s.vu_per_core(), self.vu))
            })
            .ok_or(PlacementError::NoRoom)?;
        let p = vec![best as u32];
        self.occupy(s, &p);
        Ok(p)
    }

    /// [`Board::place`], or with `Some(factor)` [`Board::place_oversubscribed`].
    pub fn place_allowing(
        &mut self,
        s: &Shape,
        oversubscribe: Option<u32>,
    ) -> Result<Placement, PlacementError> {
        match oversubscribe {
            Some(f) => self.place_oversubscribed(s, f),
            None => self.place(s),
        }
    }

    /// Whether physical core `core` holds more SAs or VUs than it has.
    pub fn oversubscribed(&self, core: usize) -> bool {
        self.cores.get(core).is_some_and(|l| l.sa > self.sa || l.vu > self.vu)
    }

    /// How many more vNPUs of shape `s` fit.
    pub fn room_for(&self, s: &Shape) -> u32 {
        let mut b = self.clone();
        let mut n = 0;
        while b.place(s).is_ok() {
            n += 1;
            if n >= 4096 {
                break;
            }
        }
        n
    }

    /// The cores where a one-core vNPU of shape `s` fits, in index order.
    pub fn fitting_cores(&self, s: &Shape) -> Vec<usize> {
        (0..self.cores.len()).filter(|&c| self.fits(c, s)).collect()
    }

    /// Places a vNPU of shape `s` as `policy` says: `cost(board, cores)`
    /// is the interference of the vNPU with its cores on the physical
    /// cores `cores` (e.g. the predicted overhead of every tenant of the
    /// board afterwards; lower is better). A one-core vNPU is priced only
    /// on the cores that are still candidates after the first criterion
    /// and only when there are two or more. A multi-core vNPU is placed
    /// chip by chip and, on each chip, core by core ([`Self::place_cores_scored`]).
    /// `Policy::Pack` is [`Board::place`].
    pub fn place_scored(
        &mut self,
        s: &Shape,
        policy: Policy,
        cost: &mut dyn FnMut(&Board, &[u32]) -> f64,
    ) -> Result<Placement, PlacementError> {
        if policy == Policy::Pack {
            return self.place(s);
        }
        if s.chips() != 1 || s.cores_per_chip() != 1 {
            return self.place_cores_scored(s, policy, cost);
        }
        let fitting = self.fitting_cores(s);
        if fitting.is_empty() {
            // The same error `place` gives (never fits / no room).
            return self.place(s);
        }
        let candidates: Vec<usize> = match policy {
            Policy::Interference => {
                let best = fitting.iter().map(|&c| self.score(c, s).0).min().unwrap_or(0);
                fitting.into_iter().filter(|&c| self.score(c, s).0 == best).collect()
            }
            _ => fitting,
        };
        let pick = if candidates.len() == 1 {
            candidates[0]
        } else {
            let keyed: Vec<(usize, i64)> =
                candidates.iter().map(|&c| (c, cost_key(cost(self, &[c as u32])))).collect();
            let Some(&(pick, _)) = keyed.iter().min_by_key(|&&(c, k)| {
                let (eu_left, balance) = self.score(c, s);
                (k, eu_left, balance)
            }) else {
                return Err(PlacementError::NoRoom);
            };
            pick
        };
        let p = vec![pick as u32];
        self.occupy(s, &p);
        Ok(p)
    }

    /// [`Board::place_scored`] for a vNPU of several cores: each vNPU
    /// chip on a distinct physical chip, each of its cores on a distinct
    /// core of that chip, as [`Board::place`] requires. For each vNPU chip
    /// in turn, every physical chip not used yet is filled greedily, one
    /// core at a time: among the chip's cores where the next core fits
    /// (`Interference`: only those that pack best, as for one core), the
    /// one whose `cost` with the cores chosen so far is least, packing
    /// breaking ties. The chip whose whole set is best (`Interference`:
    /// packing, then cost; `InterferenceFirst`: cost, then packing) is
    /// taken. Greedy, not exhaustive: a board may have up to 256 cores a
    /// chip. On error nothing changes.
    fn place_cores_scored(
        &mut self,
        s: &Shape,
        policy: Policy,
        cost: &mut dyn FnMut(&Board, &[u32]) -> f64,
    ) -> Result<Placement, PlacementError> {
        self.check(s)?;
        let pack_first = policy == Policy::Interference;
        let cost = std::cell::RefCell::new(cost);
        let price = |t: &Board, cores: &[u32]| cost_key((*cost.borrow_mut())(t, cores));
        let pick = |t: &Board, with: &[u32], fitting: &[u32]| {
            let least = fitting.iter().map(|&c| t.score(c as usize, s).0).min();
            fitting
                .iter()
                .filter(|&&c| !pack_first || Some(t.score(c as usize, s).0) == least)
                .map(|&c| (c, price(t, &[with, &[c]].concat())))
                .min_by_key(|&(c, k)| {
                    let (eu_left, balance) = t.score(c as usize, s);
                    if pack_first {
                        (i64::from(eu_left), k, balance)
                    } else {
                        (k, i64::from(eu_left), balance)
                    }
                })
                .map(|(c, _)| c)
        };
        let key = |t: &Board, with: &[u32], total: (u32, u64)| {
            let (pack, k) = (i64::from(total.0), price(t, with));
            if pack_first {
                (pack, k)
            } else {
                (k, pack)
            }
        };
        self.place_chip_by_chip(s, pick, key)
    }

    /// The best core for a one-core vNPU of shape `s` and its score.
    pub fn best_core(&self, s: &Shape) -> Option<(usize, (u32, u64))> {
        (0..self.cores.len()).filter(|&c| self.fits(c, s)).map(|c| (c, self.score(c, s))).min_by_key(|x| x.1)
    }

    /// SRAM in use over all cores, and the total.
    pub fn sram_use(&self) -> (u64, u64) {
        (self.cores.iter().map(|c| c.sram).sum(), self.cores.len() as u64 * self.sram)
    }

    /// Execution units in use over all cores, and the total.
    pub fn eu_use(&self) -> (u64, u64) {
        let used = self.cores.iter().map(|c| u64::from(c.sa + c.vu)).sum();
        (used, self.cores.len() as u64 * u64::from(self.sa + self.vu))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vnpu_spec::VnpuSpec;

    fn shape(s: &str) -> Shape {
        VnpuSpec::parse(s).unwrap()
    }

    #[test]
    fn fills_cores_before_opening_new_ones_and_says_when_full() {
        let mut b = Board::new(&BoardConfig::test_board()); // the test board: 4 cores of 4 SA + 4 VU, 32 MiB
        let small = shape("type=small");
        let first = b.place(&small).unwrap();
        let second = b.place(&small).unwrap();
        assert_eq!(first, second, "best fit packs the same core");
        assert_eq!(b.room_for(&small), 14);
        let large = shape("type=large");
        // 4 SA + 4 VU: needs an empty core; three are left.
        assert_eq!(b.room_for(&large), 3);
        for _ in 0..3 {
            b.place(&large).unwrap();
        }
        assert_eq!(b.place(&large), Err(PlacementError::NoRoom));
        assert_eq!(b.room_for(&small), 2);
        assert!(matches!(
            b.place(&shape("sa=5,vu=1,sram=2M,hbm=256M")),
            Err(PlacementError::NeverFits { .. })
        ));
    }

    #[test]
    fn balances_eus_against_memory() {
        let mut b = Board::new(&BoardConfig::test_board());
        // An EU-heavy, memory-light vNPU and a memory-heavy, EU-light one
        // share a core instead of each filling one dimension of a core.
        let eu_heavy = shape("sa=3,vu=3,sram=2M,hbm=256M");
        let mem_heavy = shape("sa=1,vu=1,sram=28M,hbm=256M");
        let a = b.place(&eu_heavy).unwrap();
        let m = b.place(&mem_heavy).unwrap();
        assert_eq!(a, m);
        let (used, total) = b.eu_use();
        assert_eq!((used, total), (8, 32));
    }

    #[test]
    fn oversubscription_shares_the_least_loaded_core_within_memory() {
        let mut b = Board::new(&BoardConfig::test_board());
        let large = shape("type=large"); // 4 + 4, 32 MiB: a whole core
        for _ in 0..4 {
            b.place(&large).unwrap();
        }
        // Memory is full everywhere: even oversubscription refuses.
        assert_eq!(b.place_oversubscribed(&large, 2), Err(PlacementError::NoRoom));
        let mut b = Board::new(&BoardConfig::test_board());
        let big = shape("sa=4,vu=4,sram=8M,hbm=1G");
        for _ in 0..4 {
            b.place(&big).unwrap();
        }
        assert_eq!(b.place(&big), Err(PlacementError::NoRoom));
        let p = b.place_oversubscribed(&big, 2).unwrap();
        assert!(b.oversubscribed(p[0] as usize));
        // The next one goes to another core, not on top of the same one.
        let q = b.place_oversubscribed(&big, 2).unwrap();
        assert_ne!(p, q);
        for _ in 0..2 {
            b.place_oversubscribed(&big, 2).unwrap();
        }
        // Every core at 2x: the factor is the limit.
        assert_eq!(b.place_oversubscribed(&big, 2), Err(PlacementError::NoRoom));
    }

    #[test]
    fn multi_core_vnpus_take_distinct_cores() {
        let mut b = Board::new(&BoardConfig::test_board());
        let p = b.place(&shape("sa=2,vu=2,sram=8M,hbm=1G,cores=3")).unwrap();
        assert_eq!(p.len(), 3);
        let mut d = p.clone();
        d.dedup();
        assert_eq!(d.len(), 3);
        assert!(matches!(
            b.place(&shape("sa=1,vu=1,sram=2M,hbm=256M,cores=5")),
            Err(PlacementError::TooManyChips { .. })
        ));
    }

    #[test]
    fn scored_placement_follows_its_policy() {
        let small = shape("sa=1,vu=1,sram=2M,hbm=256M");
        // Cores 0 and 1 hold one small vNPU each, 2 and 3 are empty.
        let fresh = || {
            let mut b = Board::new(&BoardConfig::test_board());
            b.occupy(&small, &[0]);
            b.occupy(&small, &[1]);
            b
        };
        // Interference is cheapest on core 3, then 1, then 2, then 0.
        let price = [4.0, 2.0, 3.0, 1.0];
        let asked = std::cell::RefCell::new(Vec::new());
        let mut cost = |_: &Board, c: &[u32]| {
            asked.borrow_mut().push(c[0] as usize);
            price[c[0] as usize]
        };
        // Packing first: only cores 0 and 1 pack best; 1 is cheaper.
        assert_eq!(fresh().place_scored(&small, Policy::Interference, &mut cost), Ok(vec![1]));
        assert_eq!(*asked.borrow(), [0, 1], "only the best-packed cores are priced");
        asked.borrow_mut().clear();
        // Interference first: the cheapest core, though it is empty.
        assert_eq!(fresh().place_scored(&small, Policy::InterferenceFirst, &mut cost), Ok(vec![3]));
        assert_eq!(*asked.borrow(), [0, 1, 2, 3]);
        asked.borrow_mut().clear();
        // Pack never asks; it takes the lowest-numbered best fit.
        assert_eq!(fresh().place_scored(&small, Policy::Pack, &mut cost), Ok(vec![0]));
        assert!(asked.borrow().is_empty());
        // A cost that could not be computed comes last; ties fall to packing.
        let mut nan = |_: &Board, c: &[u32]| if c == [3] { f64::NAN } else { 1.0 };
        assert_eq!(fresh().place_scored(&small, Policy::InterferenceFirst, &mut nan), Ok(vec![0]));
        // One candidate: nothing to price.
        let mut b = fresh();
        b.occupy(&shape("sa=3,vu=3,sram=2M,hbm=256M"), &[1]);
        let mut never = |_: &Board, _: &[u32]| -> f64 { panic!("priced a forced choice") };
        assert_eq!(b.place_scored(&small, Policy::Interference, &mut never), Ok(vec![0]));
        // Full: the same error as `place`.
        let mut b = Board::new(&BoardConfig::test_board());
        let large = shape("type=large");
        for c in 0..4 {
            b.occupy(&large, &[c]);
        }
        assert_eq!(b.place_scored(&small, Policy::InterferenceFirst, &mut nan), Err(PlacementError::NoRoom));
        assert_eq!("interference-first".parse(), Ok(Policy::InterferenceFirst));
        assert!("spread".parse::<Policy>().unwrap_err().contains("pack, interference"));
    }

    #[test]
    fn multi_core_vnpus_are_placed_by_interference_core_by_core() {
        let cfg = BoardConfig { chips: 2, ..BoardConfig::test_board() };
        let small = shape("sa=1,vu=1,sram=2M,hbm=256M");
        let two = shape("sa=1,vu=1,sram=2M,hbm=256M,cores=2");
        // A cost per physical core; a set of cores costs their sum.
        let price = [5.0, 1.0, 4.0, 2.0, 3.0, 3.0, 0.5, 9.0];
        let mut sum = |_: &Board, c: &[u32]| c.iter().map(|&i| price[i as usize]).sum::<f64>();
        // Interference first on an empty board: chip 0 gives 1 + 2 (cores
        // 1 and 3), chip 1 0.5 + 3: chip 0, its cheapest core first.
        let mut b = Board::new(&cfg);
        assert_eq!(b.place_scored(&two, Policy::InterferenceFirst, &mut sum), Ok(vec![1, 3]));
        assert_eq!((b.cores[1].sa, b.cores[3].sa, b.cores[0].sa), (1, 1, 0));
        // Packing first: cores 0, 1 and 4 hold a small vNPU each. Chip 0
        // packs best (its two half-used cores), and of those the cheaper
        // goes first; interference first takes the cheapest pair of the
        // board instead (chip 0: 1 + 2 against chip 1: 0.5 + 3).
        let used = || {
            let mut b = Board::new(&cfg);
            for c in [0, 1, 4] {
                b.occupy(&small, &[c]);
            }
            b
        };
        assert_eq!(used().place_scored(&two, Policy::Interference, &mut sum), Ok(vec![1, 0]));
        assert_eq!(used().place_scored(&two, Policy::InterferenceFirst, &mut sum), Ok(vec![1, 3]));
        // Each set priced is the vNPU's cores so far with the candidate.
        let mut asked: Vec<Vec<u32>> = Vec::new();
        let mut log = |_: &Board, c: &[u32]| {
            asked.push(c.to_vec());
            c.iter().map(|&i| price[i as usize]).sum::<f64>()
        };
        used().place_scored(&two, Policy::InterferenceFirst, &mut log).unwrap();
        assert!(asked.contains(&vec![1, 3]) && asked.contains(&vec![6, 4]), "{asked:?}");
        assert!(asked
            .iter()
            .all(|a| a.len() <= 2 && a.iter().all(|&c| a.iter().filter(|&&d| d == c).count() == 1)));
        // Two chips: one core on each, the cheapest of each chip.
        let across = shape("sa=1,vu=1,sram=2M,hbm=256M,chips=2");
        assert_eq!(
            Board::new(&cfg).place_scored(&across, Policy::InterferenceFirst, &mut sum),
            Ok(vec![6, 1])
        );
        // A vNPU whose cores fit on no chip: `place`'s errors, nothing taken.
        let mut b = Board::new(&cfg);
        let three = shape("sa=4,vu=4,sram=2M,hbm=256M,cores=4");
        b.occupy(&small, &[0]);
        b.occupy(&small, &[4]);
        let before = b.cores.clone();
        assert_eq!(b.place_scored(&three, Policy::InterferenceFirst, &mut sum), Err(PlacementError::NoRoom));
        assert_eq!(b.cores, before);
        let wide = shape("sa=1,vu=1,sram=2M,hbm=256M,chips=3");
        assert!(matches!(
            Board::new(&cfg).place_scored(&wide, Policy::Interference, &mut sum),
            Err(PlacementError::TooManyChips { .. })
        ));
        // A cost that cannot be computed comes last.
        let mut nan = |_: &Board, c: &[u32]| if c.contains(&1) { f64::NAN } else { c.len() as f64 };
        assert_eq!(Board::new(&cfg).place_scored(&two, Policy::InterferenceFirst, &mut nan), Ok(vec![0, 2]));
    }
}
