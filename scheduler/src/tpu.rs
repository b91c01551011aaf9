//! The TPU model of TPU.md: generations, accelerator types, topologies, what a host
//! advertises, aligned chip blocks ([`ChipAllocator`]) and the per-process environment.
//!
//! All pure: the environment arrives as a map, nothing reads `/dev`, `/sys` or the metadata
//! server here.

use std::collections::BTreeMap;
use std::fmt;

use crate::labels::{Labels, RAY_PREFIX, TPURAY_PREFIX};
use crate::resources::{Amount, ResourceSet, UNITS_PER_WHOLE};

/// Chips per host in multi-host slices, for every generation (TPU.md).
pub const CHIPS_PER_MULTI_HOST: u32 = 4;
/// Valid v5e/v6e topologies (Google's tables).
pub const V5E_V6E_TOPOLOGIES: [&str; 8] =
    ["1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"];
/// Chip counts a process may hold besides the whole host (SCHED-13).
pub const VALID_CHIP_COUNTS: [u32; 4] = [1, 2, 4, 8];

/// A problem with TPU metadata, a topology or a chip request.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TpuError {
    #[error(
        "unknown TPU accelerator type {0:?} (expected e.g. \"v6e-16\", \"v5litepod-8\", \"v4-32\", \"v5p-8\", \"v7x-8\")"
    )]
    UnknownAcceleratorType(String),
    #[error("invalid TPU topology {0:?} (expected dimensions like \"4x4\" or \"2x2x4\")")]
    InvalidTopology(String),
    #[error("TPU topology {topology:?} is not valid for {generation} (valid: {valid})")]
    TopologyNotForGeneration { topology: String, generation: TpuGeneration, valid: String },
    #[error(
        "TPU topology {topology:?} has {topology_chips} chips but {accelerator_type} has {chips}"
    )]
    TopologyMismatch { topology: String, topology_chips: u32, accelerator_type: String, chips: u32 },
    #[error(
        "unknown TPU version {0:?} (expected one of \"v4\", \"v5p\", \"v5e\"/\"v5litepod\", \"v6e\", \"v7x\")"
    )]
    UnknownGeneration(String),
    #[error("{0} is not set (needed for a TPU host)")]
    MissingEnv(&'static str),
    #[error("{name}={value:?} is not a valid {what}")]
    InvalidEnv { name: &'static str, value: String, what: &'static str },
    #[error(
        "TPU_WORKER_ID={worker_id} is beyond the {hosts} host(s) of {accelerator_type} (expected 0 to {})", .hosts.saturating_sub(1)
    )]
    WorkerIdOutOfRange { worker_id: u32, hosts: u32, accelerator_type: String },
    #[error("TPU_WORKER_HOSTNAMES lists {listed} host(s) but {accelerator_type} has {hosts}")]
    HostnameCount { listed: usize, hosts: u32, accelerator_type: String },
    #[error("host has {host_chips} TPU chip(s) but each host of {accelerator_type} has {expected}")]
    ChipCountMismatch { host_chips: u32, expected: u32, accelerator_type: String },
}

/// A TPU generation; the spellings `tpu7x`, `7x` normalise to [`TpuGeneration::V7x`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TpuGeneration {
    V4,
    V5p,
    /// v5e, whose accelerator types are spelled `v5litepod-N`.
    V5e,
    V6e,
    V7x,
}

impl TpuGeneration {
    /// Every generation, oldest first.
    pub const ALL: [TpuGeneration; 5] = [Self::V4, Self::V5p, Self::V5e, Self::V6e, Self::V7x];

    /// Parses a generation name, case-insensitive: `v4`, `v5p`, `v5e`/`v5litepod`, `v6e`,
    /// `v7x`/`tpu7x`/`7x`; a `TPU-` prefix (as in `TPU-V6E`) is accepted.
    pub fn parse(s: &str) -> Option<TpuGeneration> {
        let lower = s.trim().to_ascii_lowercase();
        let g = lower.strip_prefix("tpu-").unwrap_or(&lower);
        Some(match g {
            "v4" => Self::V4,
            "v5p" => Self::V5p,
            "v5e" | "v5litepod" | "v5lite" => Self::V5e,
            "v6e" => Self::V6e,
            "v7x" | "tpu7x" | "7x" => Self::V7x,
            _ => return None,
        })
    }

    /// The accelerator type prefix: `v4`, `v5p`, `v5litepod`, `v6e`, `v7x`.
    pub fn prefix(self) -> &'static str {
        match self {
            Self::V4 => "v4",
            Self::V5p => "v5p",
            Self::V5e => "v5litepod",
            Self::V6e => "v6e",
            Self::V7x => "v7x",
        }
    }

    /// TensorCores per chip (TPU.md table).
    pub fn cores_per_chip(self) -> u32 {
        match self {
            Self::V4 | Self::V5p | Self::V7x => 2,
            Self::V5e | Self::V6e => 1,
        }
    }

    /// Devices (PCI functions) per chip: 2 on v7x, else 1.
    pub fn devices_per_chip(self) -> u32 {
        if self == Self::V7x { 2 } else { 1 }
    }

    /// The number in `<prefix>-N` per chip: N counts TensorCores, so 2 on v4, v5p and
    /// v7x, 1 on v5e and v6e (TPU.md's table; `tpu7x-16` is 8 chips in `2x2x2`, as Ray
    /// reads it since ray PR#60338 and PR#62526).
    pub fn type_number_per_chip(self) -> u32 {
        self.cores_per_chip()
    }

    /// True when topologies have two dimensions (v5e, v6e); else three.
    pub fn is_2d(self) -> bool {
        matches!(self, Self::V5e | Self::V6e)
    }

    /// The `accelerator_type:` resource suffix and label value: `TPU-` + the prefix
    /// upper-cased (`TPU-V6E`, `TPU-V5LITEPOD`, as Ray spells them).
    pub fn accelerator_label(self) -> String {
        format!("TPU-{}", self.prefix().to_ascii_uppercase())
    }
}

impl fmt::Display for TpuGeneration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.prefix())
    }
}

/// A parsed accelerator type such as `v6e-16` (16 chips) or `v4-32` (16 chips, 32 cores).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AcceleratorType {
    pub generation: TpuGeneration,
    /// Chips in the slice.
    pub chips: u32,
}

impl AcceleratorType {
    /// Parses `v6e-16`, `v5litepod-8`, `v4-32`, `tpu7x-16`, `7x-16` (case-insensitive).
    /// Errors: an unknown prefix, a missing or zero count, an odd core count on v4, v5p
    /// or v7x.
    pub fn parse(s: &str) -> Result<AcceleratorType, TpuError> {
        let bad = || TpuError::UnknownAcceleratorType(s.to_string());
        let (prefix, n) = s.trim().rsplit_once('-').ok_or_else(bad)?;
        let generation = TpuGeneration::parse(prefix).ok_or_else(bad)?;
        let n: u32 = n.parse().map_err(|_| bad())?;
        let per = generation.type_number_per_chip();
        if n == 0 || !n.is_multiple_of(per) {
            return Err(bad());
        }
        Ok(AcceleratorType { generation, chips: n / per })
    }

    /// The slice type of `topology` on `version` (Ray's `slice_placement_group(topology,
    /// accelerator_version)` derives it the same way): `("4x4", "v6e")` → `v6e-16`,
    /// `("2x2x2", "v4")` → `v4-16` (v4/v5p count cores). Errors: unknown version, bad
    /// topology, or a topology not valid for the generation (TPU.md).
    pub fn from_topology(topology: &str, version: &str) -> Result<AcceleratorType, TpuError> {
        let generation = TpuGeneration::parse(version)
            .ok_or_else(|| TpuError::UnknownGeneration(version.to_string()))?;
        let topo = Topology::parse(topology)?;
        topo.validate_for(generation)?;
        Ok(AcceleratorType { generation, chips: topo.chips() })
    }

    /// `TPU-<type>-head`, e.g. `TPU-v6e-16-head`: the resource only worker 0 of a slice
    /// advertises (SCHED-11; Ray's name).
    pub fn head_resource_name(&self) -> String {
        format!("TPU-{self}-head")
    }

    /// Hosts in the slice: max(1, chips / 4), except single-host v5e/v6e types of up to 8.
    pub fn hosts(&self) -> u32 {
        if self.generation.is_2d() && self.chips <= 8 {
            return 1;
        }
        (self.chips / CHIPS_PER_MULTI_HOST).max(1)
    }

    /// Chips on each host of the slice.
    pub fn chips_per_host(&self) -> u32 {
        self.chips / self.hosts()
    }

    /// The canonical default topology for this many chips, when there is one.
    pub fn default_topology(&self) -> Option<Topology> {
        let s = if self.generation.is_2d() {
            match self.chips {
                1 => "1x1",
                4 => "2x2",
                8 => "2x4",
                16 => "4x4",
                32 => "4x8",
                64 => "8x8",
                128 => "8x16",
                256 => "16x16",
                _ => return None,
            }
        } else {
            match self.chips {
                4 => "2x2x1",
                8 => "2x2x2",
                16 => "2x2x4",
                32 => "2x4x4",
                64 => "4x4x4",
                128 => "4x4x8",
                256 => "4x8x8",
                512 => "8x8x8",
                _ => return None,
            }
        };
        Topology::parse(s).ok()
    }

    /// Checks that `topology` is valid for the generation and has this many chips.
    pub fn check_topology(&self, topology: &Topology) -> Result<(), TpuError> {
        topology.validate_for(self.generation)?;
        if topology.chips() != self.chips {
            return Err(TpuError::TopologyMismatch {
                topology: topology.to_string(),
                topology_chips: topology.chips(),
                accelerator_type: self.to_string(),
                chips: self.chips,
            });
        }
        Ok(())
    }
}

impl fmt::Display for AcceleratorType {
    /// The normalised spelling: `v6e-16`, `v4-32`, `v7x-8`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.chips * self.generation.type_number_per_chip();
        write!(f, "{}-{n}", self.generation.prefix())
    }
}

/// A slice topology: `4x4` → `[4, 4]`, `2x2x4` → `[2, 2, 4]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Topology(pub Vec<u32>);

impl Topology {
    /// Parses `AxB` or `AxBxC` with positive dimensions.
    pub fn parse(s: &str) -> Result<Topology, TpuError> {
        let dims: Option<Vec<u32>> =
            s.trim().split('x').map(|d| d.trim().parse().ok().filter(|&v: &u32| v > 0)).collect();
        match dims {
            Some(d) if (2..=3).contains(&d.len()) => Ok(Topology(d)),
            _ => Err(TpuError::InvalidTopology(s.to_string())),
        }
    }

    /// Chips = product of the dimensions.
    pub fn chips(&self) -> u32 {
        self.0.iter().product()
    }

    /// Google's valid topologies: v5e/v6e the table [`V5E_V6E_TOPOLOGIES`]; v4/v5p/v7x 3-D
    /// `2x2x1`, `2x2x2`, `2x2x4`, `2x4x4` or all dimensions multiples of 4.
    pub fn validate_for(&self, generation: TpuGeneration) -> Result<(), TpuError> {
        let s = self.to_string();
        let (ok, valid) = if generation.is_2d() {
            (V5E_V6E_TOPOLOGIES.contains(&s.as_str()), V5E_V6E_TOPOLOGIES.join(", "))
        } else {
            let small = ["2x2x1", "2x2x2", "2x2x4", "2x4x4"].contains(&s.as_str());
            let large = self.0.len() == 3 && self.0.iter().all(|d| d % 4 == 0);
            (small || large, "2x2x1, 2x2x2, 2x2x4, 2x4x4 or multiples of 4".to_string())
        };
        if ok {
            Ok(())
        } else {
            Err(TpuError::TopologyNotForGeneration { topology: s, generation, valid })
        }
    }

    /// The host grid: `(X/2, Y/2, Z)` of a 3-D topology, `(X/2, Y/2)` of a 2-D one (each at
    /// least 1).
    pub fn host_grid(&self) -> Vec<u32> {
        self.0.iter().enumerate().map(|(i, d)| if i < 2 { (d / 2).max(1) } else { *d }).collect()
    }
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.0.iter().map(u32::to_string).collect();
        f.write_str(&parts.join("x"))
    }
}

/// The per-host topology string TorchTPU expects in `TORCH_TPU_TOPOLOGY` for a single host
/// with `chips` chips (TPU.md): v4/v5p 1→`1,1,1`, 2→`1,2,1`, 4→`2,2,1`; v5e/v6e 1, 4, 8;
/// v7x (keyed by devices, two per chip) 1 chip→`1,1,1,2`, 2→`1,2,1,2`, 4→`2,2,1,2`.
pub fn per_host_topology(generation: TpuGeneration, chips: u32) -> Option<&'static str> {
    Some(match (generation, chips) {
        (TpuGeneration::V7x, 1) => "1,1,1,2",
        (TpuGeneration::V7x, 2) => "1,2,1,2",
        (TpuGeneration::V7x, 4) => "2,2,1,2",
        (TpuGeneration::V7x, _) => return None,
        (_, 1) => "1,1,1",
        (TpuGeneration::V4 | TpuGeneration::V5p, 2) => "1,2,1",
        (_, 4) => "2,2,1",
        (TpuGeneration::V5e | TpuGeneration::V6e, 8) => "2,4,1",
        _ => return None,
    })
}

/// One TPU host's slice metadata, from the `TPU_*` environment and its chip count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TpuHostInfo {
    pub accelerator_type: AcceleratorType,
    pub topology: Topology,
    /// `TPU_NAME`: the slice name.
    pub slice_name: String,
    /// `TPU_WORKER_ID`: 0-based host index in the slice.
    pub worker_id: u32,
    /// `TPU_WORKER_HOSTNAMES`, empty when unset.
    pub worker_hostnames: Vec<String>,
    /// Chips on this host (the `TPU` resource).
    pub chips: u32,
}

impl TpuHostInfo {
    /// Reads `TPU_ACCELERATOR_TYPE` (required), `TPU_NAME` (required), `TPU_WORKER_ID`
    /// (required on multi-host slices, else 0), `TPU_TOPOLOGY` (default: the canonical one
    /// for the chip count) and `TPU_WORKER_HOSTNAMES` (optional), with `chips` from
    /// `--resources '{"TPU": N}'` or detection. Errors name the variable at fault: unknown
    /// accelerator type, topology invalid or not matching the type, a worker id beyond the
    /// host count, a hostname list of the wrong length, a chip count that does not match.
    pub fn from_env(env: &BTreeMap<String, String>, chips: u32) -> Result<TpuHostInfo, TpuError> {
        let get = |k: &'static str| env.get(k).map(|v| v.trim()).filter(|v| !v.is_empty());
        let ty = get("TPU_ACCELERATOR_TYPE").ok_or(TpuError::MissingEnv("TPU_ACCELERATOR_TYPE"))?;
        let accelerator_type = AcceleratorType::parse(ty)?;
        let topology = match get("TPU_TOPOLOGY") {
            Some(t) => Topology::parse(t)?,
            None => {
                accelerator_type.default_topology().ok_or(TpuError::MissingEnv("TPU_TOPOLOGY"))?
            }
        };
        accelerator_type.check_topology(&topology)?;
        let slice_name = get("TPU_NAME").ok_or(TpuError::MissingEnv("TPU_NAME"))?.to_string();
        let hosts = accelerator_type.hosts();
        let worker_id = match get("TPU_WORKER_ID") {
            Some(v) => v.parse().map_err(|_| TpuError::InvalidEnv {
                name: "TPU_WORKER_ID",
                value: v.to_string(),
                what: "worker id (expected an integer >= 0)",
            })?,
            None if hosts == 1 => 0,
            None => return Err(TpuError::MissingEnv("TPU_WORKER_ID")),
        };
        if worker_id >= hosts {
            let accelerator_type = accelerator_type.to_string();
            return Err(TpuError::WorkerIdOutOfRange { worker_id, hosts, accelerator_type });
        }
        let worker_hostnames: Vec<String> = get("TPU_WORKER_HOSTNAMES")
            .map(|v| v.split(',').map(|h| h.trim().to_string()).collect())
            .unwrap_or_default();
        if !worker_hostnames.is_empty() && worker_hostnames.len() != hosts as usize {
            return Err(TpuError::HostnameCount {
                listed: worker_hostnames.len(),
                hosts,
                accelerator_type: accelerator_type.to_string(),
            });
        }
        if chips != accelerator_type.chips_per_host() {
            return Err(TpuError::ChipCountMismatch {
                host_chips: chips,
                expected: accelerator_type.chips_per_host(),
                accelerator_type: accelerator_type.to_string(),
            });
        }
        Ok(TpuHostInfo {
            accelerator_type,
            topology,
            slice_name,
            worker_id,
            worker_hostnames,
            chips,
        })
    }

    /// `TPU-<type>-head`, e.g. `TPU-v6e-16-head`: held by worker 0 only (SCHED-11).
    pub fn head_resource_name(&self) -> String {
        self.accelerator_type.head_resource_name()
    }

    /// The resources of TPU.md: `TPU: chips`, `accelerator_type:TPU-V6E: 1`,
    /// `<slice name>: 1`, and `TPU-<type>-head: 1` on worker 0 only (SCHED-11).
    pub fn resources(&self) -> ResourceSet {
        let mut r = ResourceSet::new();
        r.set("TPU", Amount::whole(u64::from(self.chips)));
        let accel = self.accelerator_type.generation.accelerator_label();
        r.set(&format!("accelerator_type:{accel}"), Amount::whole(1));
        r.set(&self.slice_name, Amount::whole(1));
        if self.worker_id == 0 {
            r.set(&self.head_resource_name(), Amount::whole(1));
        }
        r
    }

    /// The labels of TPU.md, under both `tpuray.io/` and `ray.io/`, values as strings.
    pub fn labels(&self) -> Labels {
        let values = [
            ("accelerator-type", self.accelerator_type.generation.accelerator_label()),
            ("tpu-slice-name", self.slice_name.clone()),
            ("tpu-worker-id", self.worker_id.to_string()),
            ("tpu-topology", self.topology.to_string()),
            ("tpu-pod-type", self.accelerator_type.to_string()),
        ];
        let mut map = BTreeMap::new();
        for (k, v) in values {
            map.insert(format!("{TPURAY_PREFIX}{k}"), v.clone());
            map.insert(format!("{RAY_PREFIX}{k}"), v);
        }
        Labels(map)
    }
}

/// A chip request or release that cannot be served.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ChipError {
    /// Not 1, 2, 4, 8 or the whole host (SCHED-13).
    #[error(
        "invalid TPU chip count {requested} (valid counts: 1, 2, 4, 8{})",
        whole_host(*host_chips)
    )]
    InvalidCount { requested: String, host_chips: u32 },
    /// Valid count, but no aligned block of that size is free now.
    #[error(
        "no free aligned block of {requested} TPU chip(s) on this host ({free} of {host_chips} free)"
    )]
    Busy { requested: u32, free: u32, host_chips: u32 },
}

/// Checks a `TPU` demand: whole chips 1, 2, 4, 8, or exactly `host_chips` when given
/// (SCHED-13). Errors name the valid counts: `0.5` and `3` are rejected.
/// The "or the whole host" part of a chip-count error (nothing while no host is known).
fn whole_host(host_chips: u32) -> String {
    if host_chips == 0 { String::new() } else { format!(" or the whole host of {host_chips}") }
}

pub fn chip_count(amount: Amount, host_chips: Option<u32>) -> Result<u32, ChipError> {
    let n = host_chips.unwrap_or(0);
    let bad = || ChipError::InvalidCount { requested: amount.to_string(), host_chips: n };
    if amount.0 <= 0 || amount.0 % UNITS_PER_WHOLE != 0 {
        return Err(bad());
    }
    let k = u32::try_from(amount.0 / UNITS_PER_WHOLE).map_err(|_| bad())?;
    let fits = host_chips.is_none_or(|n| k <= n);
    if (VALID_CHIP_COUNTS.contains(&k) && fits) || Some(k) == host_chips {
        Ok(k)
    } else {
        Err(bad())
    }
}

/// Checks the `TPU` part of a demand (directly or inside a bundle, SCHED-19): none, or a
/// valid chip count (SCHED-13). For submission-time checks, before any host is chosen.
///
/// # Errors
/// [`ChipError::InvalidCount`] naming the valid counts.
pub fn check_tpu_demand(demand: &ResourceSet) -> Result<(), ChipError> {
    let amount = crate::bundles::plain_amount(demand, "TPU");
    if amount.0 == 0 {
        return Ok(());
    }
    chip_count(amount, None).map(|_| ())
}

/// Hands out one host's chips as aligned blocks (SCHED-12): `{i}`, `{2k, 2k+1}`,
/// `{4k..4k+3}`, all 8, or the whole host; the lowest free aligned block first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChipAllocator {
    chips: u32,
    /// Bit i set = chip i in use.
    used: u64,
}

impl ChipAllocator {
    /// An allocator for a host with `chips` chips (at most 64), all free.
    pub fn new(chips: u32) -> ChipAllocator {
        assert!(chips <= 64, "a host has at most 64 TPU chips (got {chips})");
        ChipAllocator { chips, used: 0 }
    }

    /// Chips on the host.
    pub fn chips(&self) -> u32 {
        self.chips
    }

    /// Chips free now.
    pub fn free(&self) -> u32 {
        self.chips - self.used.count_ones()
    }

    /// The lowest free aligned block of `k` chips, in ascending order. Errors: `k` not 1, 2,
    /// 4, 8 or the whole host (the message names the valid counts); no such block free now.
    pub fn allocate(&mut self, k: u32) -> Result<Vec<u32>, ChipError> {
        chip_count(Amount::whole(u64::from(k)), Some(self.chips))?;
        let mask = if k >= 64 { u64::MAX } else { (1u64 << k) - 1 };
        // SCHED-12: only blocks starting at a multiple of k; the whole host starts at 0.
        let mut start = 0;
        while start + k <= self.chips {
            let block = mask << start;
            if self.used & block == 0 {
                self.used |= block;
                return Ok((start..start + k).collect());
            }
            start += k;
        }
        Err(ChipError::Busy { requested: k, free: self.free(), host_chips: self.chips })
    }

    /// Takes exactly `chips` when they are a free aligned block of a valid size (a gang
    /// member started for one chip: TPU.md "Multi-host slice gangs", one process per chip).
    ///
    /// # Errors
    /// [`ChipError::InvalidCount`] for a ragged or unaligned set or a bad count;
    /// [`ChipError::Busy`] when any of them is in use.
    pub fn allocate_exact(&mut self, chips: &[u32]) -> Result<Vec<u32>, ChipError> {
        let k = u32::try_from(chips.len()).unwrap_or(u32::MAX);
        chip_count(Amount::whole(u64::from(k)), Some(self.chips))?;
        let start = chips.first().copied().unwrap_or(0);
        let aligned = start.is_multiple_of(k.max(1))
            && start + k <= self.chips
            && chips.iter().enumerate().all(|(i, &c)| c == start + i as u32);
        if !aligned {
            return Err(ChipError::InvalidCount {
                requested: format!("{chips:?} (not an aligned block)"),
                host_chips: self.chips,
            });
        }
        let mask = if k >= 64 { u64::MAX } else { ((1u64 << k) - 1) << start };
        if self.used & mask != 0 {
            return Err(ChipError::Busy {
                requested: k,
                free: self.free(),
                host_chips: self.chips,
            });
        }
        self.used |= mask;
        Ok(chips.to_vec())
    }

    /// Frees `chips` (indices beyond the host are ignored).
    pub fn release(&mut self, chips: &[u32]) {
        for &c in chips.iter().filter(|&&c| c < self.chips) {
            self.used &= !(1u64 << c);
        }
    }
}

/// `TPU_CHIPS_PER_PROCESS_BOUNDS` for `k` chips: 1→`1,1,1`, 2→`1,2,1`, 4→`2,2,1`,
/// 8→`2,4,1`; v7x adds a fourth value, its devices per chip.
pub fn chips_per_process_bounds(generation: TpuGeneration, k: u32) -> Option<String> {
    let b = match k {
        1 => "1,1,1",
        2 => "1,2,1",
        4 => "2,2,1",
        8 => "2,4,1",
        _ => return None,
    };
    Some(if generation == TpuGeneration::V7x {
        format!("{b},{}", generation.devices_per_chip())
    } else {
        b.to_string()
    })
}

/// The environment of an independent process holding `chips` of a host's `host_chips`
/// (TPU.md "Handing chips to a process"): `TPU_VISIBLE_CHIPS` always; the libtpu port
/// (`TPU_MESH_CONTROLLER_ADDRESS=localhost:P`, `TPU_MESH_CONTROLLER_PORT`, `TPU_PROCESS_PORT`)
/// always; and, when k < n, `TPU_CHIPS_PER_PROCESS_BOUNDS`, `TPU_PROCESS_BOUNDS=1,1,1` and the
/// older `TPU_CHIPS_PER_HOST_BOUNDS` / `TPU_HOST_BOUNDS` with the same values (SCHED-14).
/// When k == n the bounds are left unset so the framework defaults.
pub fn chip_env(
    generation: TpuGeneration,
    host_chips: u32,
    chips: &[u32],
    port: u16,
) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    let mut set = |k: &str, v: String| {
        env.insert(k.to_string(), v);
    };
    let visible: Vec<String> = chips.iter().map(u32::to_string).collect();
    set("TPU_VISIBLE_CHIPS", visible.join(","));
    set("TPU_MESH_CONTROLLER_ADDRESS", format!("localhost:{port}"));
    set("TPU_MESH_CONTROLLER_PORT", port.to_string());
    set("TPU_PROCESS_PORT", port.to_string());
    let k = u32::try_from(chips.len()).unwrap_or(u32::MAX);
    if k < host_chips
        && let Some(bounds) = chips_per_process_bounds(generation, k)
    {
        set("TPU_CHIPS_PER_PROCESS_BOUNDS", bounds.clone());
        set("TPU_CHIPS_PER_HOST_BOUNDS", bounds);
        set("TPU_PROCESS_BOUNDS", "1,1,1".to_string());
        set("TPU_HOST_BOUNDS", "1,1,1".to_string());
    }
    env
}

#[cfg(test)]
mod tests {
    #[test]
    fn exact_chip_blocks_for_gang_members() {
        let mut a = ChipAllocator::new(8);
        assert_eq!(a.allocate_exact(&[5]).unwrap(), vec![5]);
        assert!(matches!(a.allocate_exact(&[5]), Err(ChipError::Busy { .. })));
        assert!(a.allocate_exact(&[1, 2]).unwrap_err().to_string().contains("aligned"));
        assert_eq!(a.allocate_exact(&[2, 3]).unwrap(), vec![2, 3]);
        // The lowest free block now skips the taken chips.
        assert_eq!(a.allocate(2).unwrap(), vec![0, 1]);
        a.release(&[5]);
        assert_eq!(a.allocate_exact(&[4, 5, 6, 7]).unwrap(), vec![4, 5, 6, 7]);
    }

    #[test]
    fn slice_type_from_topology_and_version() {
        let t = |topo, v| AcceleratorType::from_topology(topo, v).map(|t| t.to_string());
        assert_eq!(t("4x4", "v6e").unwrap(), "v6e-16");
        assert_eq!(t("2x4", "v6e").unwrap(), "v6e-8");
        assert_eq!(t("2x2x2", "v4").unwrap(), "v4-16");
        assert_eq!(t("2x2x4", "v5p").unwrap(), "v5p-32");
        assert_eq!(t("2x2x2", "v7x").unwrap(), "v7x-16");
        assert_eq!(t("2x2x1", "tpu7x").unwrap(), "v7x-8");
        assert_eq!(t("2x2x4", "7x").unwrap(), "v7x-32");
        let ty = AcceleratorType::from_topology("2x2x2", "v7x").unwrap();
        assert_eq!((ty.chips, ty.hosts(), ty.chips_per_host()), (8, 2, 4));
        assert_eq!(ty.head_resource_name(), "TPU-v7x-16-head");
        assert!(t("3x3", "v6e").unwrap_err().to_string().contains("not valid for v6e"));
        assert!(t("4x4", "v9").unwrap_err().to_string().contains("unknown TPU version"));
    }

    use super::*;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn accelerator_types_parse_to_generation_chips_and_hosts() {
        // (type, normalised, generation, chips, hosts, chips per host)
        let cases = [
            // v5e/v6e: N counts chips; single-host 1x1, 2x2, 2x4 use 1, 4, 8 chips.
            ("v6e-16", "v6e-16", TpuGeneration::V6e, 16, 4, 4),
            ("v6e-8", "v6e-8", TpuGeneration::V6e, 8, 1, 8),
            ("v6e-4", "v6e-4", TpuGeneration::V6e, 4, 1, 4),
            ("v6e-1", "v6e-1", TpuGeneration::V6e, 1, 1, 1),
            ("v6e-256", "v6e-256", TpuGeneration::V6e, 256, 64, 4),
            ("v5litepod-16", "v5litepod-16", TpuGeneration::V5e, 16, 4, 4),
            ("v5litepod-8", "v5litepod-8", TpuGeneration::V5e, 8, 1, 8),
            ("v5e-4", "v5litepod-4", TpuGeneration::V5e, 4, 1, 4),
            // v4/v5p/v7x: N counts TensorCores, two per chip; hosts of 4 chips.
            ("v4-8", "v4-8", TpuGeneration::V4, 4, 1, 4),
            ("v4-16", "v4-16", TpuGeneration::V4, 8, 2, 4),
            ("v4-32", "v4-32", TpuGeneration::V4, 16, 4, 4),
            ("v5p-8", "v5p-8", TpuGeneration::V5p, 4, 1, 4),
            ("v5p-16", "v5p-16", TpuGeneration::V5p, 8, 2, 4),
            ("tpu7x-16", "v7x-16", TpuGeneration::V7x, 8, 2, 4),
            ("v7x-16", "v7x-16", TpuGeneration::V7x, 8, 2, 4),
            ("7x-8", "v7x-8", TpuGeneration::V7x, 4, 1, 4),
            ("TPU7X-32", "v7x-32", TpuGeneration::V7x, 16, 4, 4),
            ("V6E-4", "v6e-4", TpuGeneration::V6e, 4, 1, 4),
        ];
        for (s, norm, g, chips, hosts, per) in cases {
            let t = AcceleratorType::parse(s).unwrap();
            assert_eq!((t.to_string().as_str(), t.generation, t.chips), (norm, g, chips), "{s}");
            assert_eq!((t.hosts(), t.chips_per_host()), (hosts, per), "{s}");
        }
        for bad in ["v9-8", "v6e", "v6e-0", "v4-3", "v7x-3", "tpu7x-0", "tpu", "v6e-x"] {
            let err = AcceleratorType::parse(bad).unwrap_err().to_string();
            assert!(err.starts_with(&format!("unknown TPU accelerator type {bad:?}")), "{err}");
        }
    }

    #[test]
    fn topologies_parse_validate_and_give_host_grids() {
        // (generation, topology, Ok(chips, host grid) or error fragment)
        type Case = (TpuGeneration, &'static str, Result<(u32, &'static [u32]), &'static str>);
        let cases: &[Case] = &[
            (TpuGeneration::V6e, "4x4", Ok((16, &[2, 2]))),
            (TpuGeneration::V6e, "2x4", Ok((8, &[1, 2]))),
            (TpuGeneration::V4, "2x2x4", Ok((16, &[1, 1, 4]))),
            (TpuGeneration::V5p, "4x4x8", Ok((128, &[2, 2, 8]))),
            (TpuGeneration::V6e, "3x3", Err("not valid for v6e")),
            (TpuGeneration::V6e, "2x2x4", Err("not valid for v6e")),
            (TpuGeneration::V4, "4x4", Err("not valid for v4")),
            (TpuGeneration::V4, "2x6x4", Err("not valid for v4")),
            (TpuGeneration::V4, "2xx4", Err("invalid TPU topology")),
            (TpuGeneration::V4, "0x2x2", Err("invalid TPU topology")),
        ];
        for (g, s, want) in cases {
            let got = Topology::parse(s).and_then(|t| t.validate_for(*g).map(|()| t));
            match (want, got) {
                (Ok((chips, grid)), Ok(t)) => {
                    assert_eq!((t.chips(), t.host_grid().as_slice()), (*chips, *grid), "{s}")
                }
                (Err(frag), Err(e)) => assert!(e.to_string().contains(frag), "{s}: {e}"),
                (w, g) => panic!("{s}: want {w:?}, got {g:?}"),
            }
        }
        assert_eq!(per_host_topology(TpuGeneration::V6e, 8), Some("2,4,1"));
        assert_eq!(per_host_topology(TpuGeneration::V4, 2), Some("1,2,1"));
        assert_eq!(per_host_topology(TpuGeneration::V7x, 4), Some("2,2,1,2"));
        assert_eq!(per_host_topology(TpuGeneration::V6e, 2), None);
    }

    #[test]
    fn simulated_v6e_16_host_advertises_tpu_md_resources_and_labels() {
        let e = env(&[
            ("TPU_ACCELERATOR_TYPE", "v6e-16"),
            ("TPU_NAME", "sa"),
            ("TPU_WORKER_ID", "2"),
            ("TPU_TOPOLOGY", "4x4"),
        ]);
        let h = TpuHostInfo::from_env(&e, 4).unwrap();
        let want = ResourceSet::from_json(r#"{"TPU": 4, "accelerator_type:TPU-V6E": 1, "sa": 1}"#);
        assert_eq!(h.resources(), want.unwrap());
        let l = h.labels();
        for prefix in ["tpuray.io/", "ray.io/"] {
            let get = |k: &str| l.0.get(&format!("{prefix}{k}")).map(String::as_str);
            assert_eq!(get("accelerator-type"), Some("TPU-V6E"));
            assert_eq!(get("tpu-slice-name"), Some("sa"));
            assert_eq!(get("tpu-worker-id"), Some("2"));
            assert_eq!(get("tpu-topology"), Some("4x4"));
            assert_eq!(get("tpu-pod-type"), Some("v6e-16"));
        }
        assert_eq!(l.0.len(), 10);
    }

    #[test]
    fn a_simulated_tpu7x_16_host_is_v7x_16_with_8_chips_on_2_hosts() {
        for (w, head) in [(0, true), (1, false)] {
            let e = env(&[
                ("TPU_ACCELERATOR_TYPE", "tpu7x-16"),
                ("TPU_NAME", "ix"),
                ("TPU_WORKER_ID", &w.to_string()),
                ("TPU_TOPOLOGY", "2x2x2"),
            ]);
            let h = TpuHostInfo::from_env(&e, 4).unwrap();
            let mut want = r#"{"TPU": 4, "accelerator_type:TPU-V7X": 1, "ix": 1"#.to_string();
            want += if head { r#", "TPU-v7x-16-head": 1}"# } else { "}" };
            assert_eq!(h.resources(), ResourceSet::from_json(&want).unwrap(), "worker {w}");
            assert_eq!(h.labels().0["ray.io/tpu-pod-type"], "v7x-16");
        }
        // A third host of a two-host slice is refused.
        let e = env(&[
            ("TPU_ACCELERATOR_TYPE", "tpu7x-16"),
            ("TPU_NAME", "ix"),
            ("TPU_WORKER_ID", "2"),
        ]);
        let err = TpuHostInfo::from_env(&e, 4).unwrap_err().to_string();
        assert!(err.contains("beyond the 2 host(s) of v7x-16 (expected 0 to 1)"), "{err}");
    }

    #[test]
    fn two_four_host_slices_advertise_exactly_two_head_resources_sched_11() {
        let mut heads = BTreeMap::<String, i64>::new();
        for slice in ["sa", "sb"] {
            for w in 0..4 {
                let e = env(&[
                    ("TPU_ACCELERATOR_TYPE", "v6e-16"),
                    ("TPU_NAME", slice),
                    ("TPU_WORKER_ID", &w.to_string()),
                ]);
                let r = TpuHostInfo::from_env(&e, 4).unwrap().resources();
                for (k, v) in r.iter().filter(|(k, _)| k.ends_with("-head")) {
                    *heads.entry(k.to_string()).or_default() += v.0 / UNITS_PER_WHOLE;
                }
            }
        }
        assert_eq!(heads, BTreeMap::from([("TPU-v6e-16-head".to_string(), 2)]));
    }

    #[test]
    fn inconsistent_tpu_env_is_rejected_naming_the_problem() {
        let base = [("TPU_ACCELERATOR_TYPE", "v6e-16"), ("TPU_NAME", "sa"), ("TPU_WORKER_ID", "0")];
        let with = |k: &str, v: &str| {
            let mut e = env(&base);
            e.insert(k.to_string(), v.to_string());
            e
        };
        let without = |k: &str| {
            let mut e = env(&base);
            e.remove(k);
            e
        };
        let cases = [
            (with("TPU_WORKER_ID", "4"), 4, "TPU_WORKER_ID=4 is beyond the 4 host(s) of v6e-16"),
            (with("TPU_WORKER_ID", "x"), 4, "TPU_WORKER_ID=\"x\" is not a valid worker id"),
            (with("TPU_ACCELERATOR_TYPE", "v9-16"), 4, "unknown TPU accelerator type \"v9-16\""),
            (with("TPU_TOPOLOGY", "2x4"), 4, "topology \"2x4\" has 8 chips but v6e-16 has 16"),
            (with("TPU_TOPOLOGY", "2x2x4"), 4, "not valid for v6e"),
            (with("TPU_WORKER_HOSTNAMES", "a,b"), 4, "lists 2 host(s) but v6e-16 has 4"),
            (env(&base), 8, "host has 8 TPU chip(s) but each host of v6e-16 has 4"),
            (without("TPU_NAME"), 4, "TPU_NAME is not set"),
            (without("TPU_WORKER_ID"), 4, "TPU_WORKER_ID is not set"),
            (without("TPU_ACCELERATOR_TYPE"), 4, "TPU_ACCELERATOR_TYPE is not set"),
        ];
        for (e, chips, want) in cases {
            let err = TpuHostInfo::from_env(&e, chips).unwrap_err().to_string();
            assert!(err.contains(want), "{e:?}: {err}");
        }
        // A single-host slice needs no worker id; v5e spells its label TPU-V5LITEPOD.
        let e = env(&[("TPU_ACCELERATOR_TYPE", "v5litepod-8"), ("TPU_NAME", "one")]);
        let h = TpuHostInfo::from_env(&e, 8).unwrap();
        assert_eq!((h.worker_id, h.topology.to_string()), (0, "2x4".to_string()));
        assert!(h.resources().get("TPU-v5litepod-8-head").0 > 0);
        assert!(h.resources().get("accelerator_type:TPU-V5LITEPOD").0 > 0);
    }

    /// SCHED-12: one-chip blocks are handed out lowest free first.
    #[test]
    fn eight_one_chip_requests_on_an_8_chip_host_get_chips_0_to_7_sched_12() {
        let mut a = ChipAllocator::new(8);
        let got: Vec<Vec<u32>> = (0..8).map(|_| a.allocate(1).unwrap()).collect();
        assert_eq!(got, (0..8).map(|i| vec![i]).collect::<Vec<_>>());
        assert!(matches!(a.allocate(1), Err(ChipError::Busy { free: 0, .. })));
        a.release(&[5]);
        assert_eq!(a.allocate(1).unwrap(), vec![5]);
    }

    /// SCHED-12: chips go out as the lowest free aligned block.
    #[test]
    fn chip_blocks_are_aligned_lowest_free_first_sched_12() {
        // (host chips, held before, request, expected block or None when busy)
        type Case = (u32, &'static [u32], u32, Option<&'static [u32]>);
        let cases: &[Case] = &[
            (8, &[], 4, Some(&[0, 1, 2, 3])),
            (8, &[0], 4, Some(&[4, 5, 6, 7])),
            (8, &[2], 4, Some(&[4, 5, 6, 7])),
            (8, &[0, 4], 4, None),
            (8, &[0], 2, Some(&[2, 3])),
            (8, &[1, 2], 2, Some(&[4, 5])),
            (8, &[], 8, Some(&[0, 1, 2, 3, 4, 5, 6, 7])),
            (8, &[7], 8, None),
            (4, &[], 4, Some(&[0, 1, 2, 3])),
            (4, &[3], 2, Some(&[0, 1])),
            (1, &[], 1, Some(&[0])),
        ];
        for (n, held, k, want) in cases {
            let mut a = ChipAllocator::new(*n);
            for &c in *held {
                a.used |= 1 << c;
            }
            let got = a.allocate(*k).ok();
            assert_eq!(got.as_deref(), *want, "n={n} held={held:?} k={k}");
        }
        // A 4-chip request on an 8-chip host is one of the two aligned halves.
        for start in 0..8 {
            let mut a = ChipAllocator::new(8);
            a.used |= 1 << start;
            let got = a.allocate(4).unwrap();
            assert!(got == [0, 1, 2, 3] || got == [4, 5, 6, 7]);
        }
    }

    #[test]
    fn chip_counts_other_than_1_2_4_8_or_whole_host_are_rejected_sched_13() {
        let amount = |v: f64| Amount::from_f64("TPU", v).unwrap();
        // (amount, host chips, Ok(count) or error)
        let cases: &[(f64, Option<u32>, Result<u32, &str>)] = &[
            (1.0, Some(8), Ok(1)),
            (2.0, Some(8), Ok(2)),
            (4.0, Some(8), Ok(4)),
            (8.0, Some(8), Ok(8)),
            (8.0, None, Ok(8)),
            (6.0, Some(6), Ok(6)),
            (
                3.0,
                Some(8),
                Err("invalid TPU chip count 3 (valid counts: 1, 2, 4, 8 or the whole host of 8)"),
            ),
            (0.5, Some(8), Err("invalid TPU chip count 0.5 (valid counts: 1, 2, 4, 8")),
            (0.5, None, Err("invalid TPU chip count 0.5 (valid counts: 1, 2, 4, 8")),
            (0.0, Some(4), Err("invalid TPU chip count 0 (valid counts")),
            (
                8.0,
                Some(4),
                Err("invalid TPU chip count 8 (valid counts: 1, 2, 4, 8 or the whole host of 4)"),
            ),
            (16.0, None, Err("invalid TPU chip count 16")),
        ];
        for (v, n, want) in cases {
            let got = chip_count(amount(*v), *n).map_err(|e| e.to_string());
            match want {
                Ok(k) => assert_eq!(got, Ok(*k), "{v}"),
                Err(m) => assert!(got.as_ref().unwrap_err().contains(m), "{v}: {got:?}"),
            }
        }
        let err = ChipAllocator::new(8).allocate(3).unwrap_err().to_string();
        assert!(err.contains("valid counts: 1, 2, 4, 8"), "{err}");
    }

    #[test]
    fn chip_env_sets_bounds_below_whole_host_and_leaves_them_unset_for_it_sched_14() {
        let e = chip_env(TpuGeneration::V6e, 8, &[4, 5, 6, 7], 8476);
        let want = [
            ("TPU_VISIBLE_CHIPS", "4,5,6,7"),
            ("TPU_CHIPS_PER_PROCESS_BOUNDS", "2,2,1"),
            ("TPU_CHIPS_PER_HOST_BOUNDS", "2,2,1"),
            ("TPU_PROCESS_BOUNDS", "1,1,1"),
            ("TPU_HOST_BOUNDS", "1,1,1"),
            ("TPU_MESH_CONTROLLER_ADDRESS", "localhost:8476"),
            ("TPU_MESH_CONTROLLER_PORT", "8476"),
            ("TPU_PROCESS_PORT", "8476"),
        ];
        assert_eq!(e, env(&want));
        // (generation, host chips, chips, bounds or None)
        let cases: &[(TpuGeneration, u32, &[u32], Option<&str>)] = &[
            (TpuGeneration::V6e, 8, &[3], Some("1,1,1")),
            (TpuGeneration::V6e, 8, &[2, 3], Some("1,2,1")),
            (TpuGeneration::V6e, 8, &[0, 1, 2, 3, 4, 5, 6, 7], None),
            (TpuGeneration::V6e, 4, &[0, 1, 2, 3], None),
            (TpuGeneration::V7x, 4, &[0, 1], Some("1,2,1,2")),
            (TpuGeneration::V7x, 4, &[2, 3], Some("1,2,1,2")),
            (TpuGeneration::V7x, 4, &[0], Some("1,1,1,2")),
            (TpuGeneration::V7x, 4, &[3], Some("1,1,1,2")),
            (TpuGeneration::V7x, 4, &[0, 1, 2, 3], None),
            (TpuGeneration::V4, 4, &[1], Some("1,1,1")),
        ];
        for (g, n, chips, bounds) in cases {
            let e = chip_env(*g, *n, chips, 9000);
            assert_eq!(e.get("TPU_CHIPS_PER_PROCESS_BOUNDS").map(String::as_str), *bounds);
            assert_eq!(e.get("TPU_CHIPS_PER_HOST_BOUNDS").map(String::as_str), *bounds);
            assert_eq!(e.contains_key("TPU_PROCESS_BOUNDS"), bounds.is_some());
        }
    }
}
