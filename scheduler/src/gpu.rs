//! GPU ids for worker processes (`CUDA_VISIBLE_DEVICES` isolation, as Ray does): a process
//! asking for `g` GPUs gets `g` whole GPUs of its own when `g >= 1`, or a share of one GPU
//! when `g < 1`, and sees only those ids.
//!
//! - GPU-1: whole GPUs are never shared; fractional shares of one GPU never add up to more
//!   than the GPU; what is released comes back exactly (fixed point, SCHED-1).
//! - GPU-2: more than one GPU must be a whole number (Ray's rule: "num_gpus greater than 1
//!   must be an integer").

use crate::resources::{Amount, UNITS_PER_WHOLE};

/// A GPU request that cannot be served.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum GpuError {
    #[error("invalid GPU request {0} (more than one GPU must be a whole number)")]
    NotWhole(f64),
    #[error("no {requested} GPU(s) free on this node ({free} of {total} whole GPUs free)")]
    Busy { requested: f64, free: u32, total: u32 },
}

/// The GPUs of one node and what each still has free.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuAllocator {
    free: Vec<Amount>,
}

impl GpuAllocator {
    /// `gpus` whole GPUs with ids `0..gpus`, all free.
    pub fn new(gpus: u32) -> Self {
        GpuAllocator { free: vec![Amount(UNITS_PER_WHOLE); gpus as usize] }
    }

    /// GPUs on the node.
    pub fn total(&self) -> u32 {
        self.free.len() as u32
    }

    /// GPUs with nothing handed out.
    pub fn whole_free(&self) -> u32 {
        self.free.iter().filter(|f| f.0 == UNITS_PER_WHOLE).count() as u32
    }

    /// Hands out `amount` of GPU: the lowest fully free ids for a whole number, else the
    /// lowest id with that much left. Returns `(id, share)` pairs.
    ///
    /// # Errors
    /// [`GpuError::NotWhole`] for e.g. 1.5; [`GpuError::Busy`] when not enough is free.
    pub fn allocate(&mut self, amount: Amount) -> Result<Vec<(u32, Amount)>, GpuError> {
        if amount.0 <= 0 {
            return Ok(vec![]);
        }
        let busy = |s: &Self| GpuError::Busy {
            requested: amount.to_f64(),
            free: s.whole_free(),
            total: s.total(),
        };
        if amount.0 < UNITS_PER_WHOLE {
            let id = self.free.iter().position(|f| f.0 >= amount.0).ok_or_else(|| busy(self))?;
            self.free[id].0 -= amount.0;
            return Ok(vec![(id as u32, amount)]);
        }
        if amount.0 % UNITS_PER_WHOLE != 0 {
            return Err(GpuError::NotWhole(amount.to_f64()));
        }
        let k = (amount.0 / UNITS_PER_WHOLE) as usize;
        let ids: Vec<usize> =
            (0..self.free.len()).filter(|&i| self.free[i].0 == UNITS_PER_WHOLE).take(k).collect();
        if ids.len() < k {
            return Err(busy(self));
        }
        for &i in &ids {
            self.free[i] = Amount::ZERO;
        }
        Ok(ids.into_iter().map(|i| (i as u32, Amount(UNITS_PER_WHOLE))).collect())
    }

    /// Gives shares back (ids beyond the node are ignored; never above one whole GPU).
    pub fn release(&mut self, shares: &[(u32, Amount)]) {
        for &(id, share) in shares {
            if let Some(f) = self.free.get_mut(id as usize) {
                f.0 = (f.0 + share.0).min(UNITS_PER_WHOLE);
            }
        }
    }
}

/// Checks a demand's `GPU` at submission (GPU-2): more than one GPU must be whole.
///
/// # Errors
/// [`GpuError::NotWhole`] naming the amount.
pub fn check_gpu_demand(demand: &crate::ResourceSet) -> Result<(), GpuError> {
    let a = demand.get("GPU");
    if a.0 > UNITS_PER_WHOLE && a.0 % UNITS_PER_WHOLE != 0 {
        return Err(GpuError::NotWhole(a.to_f64()));
    }
    Ok(())
}

/// `CUDA_VISIBLE_DEVICES` for a process holding `shares` (ids comma separated).
pub fn cuda_visible_devices(shares: &[(u32, Amount)]) -> String {
    let ids: Vec<String> = shares.iter().map(|(id, _)| id.to_string()).collect();
    ids.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpus(v: f64) -> Amount {
        Amount::from_f64("GPU", v).unwrap()
    }

    #[test]
    fn whole_gpus_are_exclusive_and_lowest_first() {
        let mut a = GpuAllocator::new(4);
        let one = a.allocate(gpus(1.0)).unwrap();
        assert_eq!(cuda_visible_devices(&one), "0");
        let two = a.allocate(gpus(2.0)).unwrap();
        assert_eq!(cuda_visible_devices(&two), "1,2");
        assert!(matches!(a.allocate(gpus(2.0)), Err(GpuError::Busy { free: 1, total: 4, .. })));
        a.release(&one);
        assert_eq!(cuda_visible_devices(&a.allocate(gpus(2.0)).unwrap()), "0,3");
    }

    #[test]
    fn fractions_share_one_gpu_up_to_its_size() {
        let mut a = GpuAllocator::new(2);
        let x = a.allocate(gpus(0.5)).unwrap();
        let y = a.allocate(gpus(0.5)).unwrap();
        assert_eq!((cuda_visible_devices(&x), cuda_visible_devices(&y)), ("0".into(), "0".into()));
        // GPU 0 is full: the next share goes to GPU 1, and no whole GPU 0 is left.
        assert_eq!(cuda_visible_devices(&a.allocate(gpus(0.3)).unwrap()), "1");
        assert!(a.allocate(gpus(1.0)).is_err());
        a.release(&x);
        a.release(&y);
        assert_eq!(cuda_visible_devices(&a.allocate(gpus(1.0)).unwrap()), "0");
    }

    /// GPU-2: more than one GPU must be a whole number.
    #[test]
    fn more_than_one_gpu_must_be_whole() {
        let mut a = GpuAllocator::new(4);
        assert!(a.allocate(gpus(1.5)).unwrap_err().to_string().contains("whole number"));
        assert!(a.allocate(Amount::ZERO).unwrap().is_empty());
    }
}
