//! What this machine has: CPUs, memory, TPU chips and NVIDIA GPUs. Everything here blocks
//! (reads `/proc`, `/dev` and `/sys`, or runs `nvidia-smi`) and is called once at start.
//!
//! TPU detection follows TPU.md "Detecting chips on a host" and takes a root path so tests
//! build a fake `/dev` + `/sys` tree; it fails closed: anything unreadable or foreign counts
//! zero chips, with a reason saying why.
//!
//! TPU chips are counted from `/dev/accel*` or Google VFIO devices under a root path
//! (`TPURAY_ACCELERATOR_ROOT`, default `/`); NVIDIA GPUs through `nvidia-smi` when
//! `/dev/nvidia*` exists. Flags and `--resources '{"TPU": N}'` win over detection (a
//! simulated TPU host, TPU.md).

use std::fs;
use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tpuray_scheduler::TpuGeneration;

/// Logical CPUs available to this process.
pub fn num_cpus() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// `MemTotal` and `MemAvailable` from `/proc/meminfo`, in bytes (the store's reader,
/// which drivers without a node use too).
pub use tpuray_objectstore::memory_bytes;

/// Default object store size when `--object-store-memory` is not given
/// (see [`tpuray_objectstore::default_capacity`]).
pub fn default_object_store_bytes(available: u64) -> u64 {
    tpuray_objectstore::default_capacity(available)
}

/// The `memory` resource: 70% of available memory minus the object store
/// (Ray reports the memory left for tasks and actors the same way).
pub fn memory_resource_bytes(available: u64, object_store: u64) -> u64 {
    ((available as f64 * 0.7) as u64).saturating_sub(object_store)
}

/// PCI vendor id of Google (TPU.md "Generations and chips", last column).
pub const GOOGLE_PCI_VENDOR: u16 = 0x1ae0;

/// PCI device ids of TPU chips under [`GOOGLE_PCI_VENDOR`] (TPU.md "Generations and chips").
/// Other Google devices, such as the gVNIC network card, are not TPUs.
pub const TPU_PCI_DEVICES: [(u16, TpuGeneration); 5] = [
    (0x005e, TpuGeneration::V4),
    (0x0062, TpuGeneration::V5p),
    (0x0063, TpuGeneration::V5e),
    (0x006f, TpuGeneration::V6e),
    (0x0076, TpuGeneration::V7x),
];

/// The generation of a Google PCI device id ([`TPU_PCI_DEVICES`]); `None` when it is not a TPU.
pub fn tpu_generation_for_pci_device(device: u16) -> Option<TpuGeneration> {
    TPU_PCI_DEVICES.iter().find(|(id, _)| *id == device).map(|(_, g)| *g)
}

/// What [`detect_tpus`] found on a host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TpuDetection {
    /// TPU chips: the amount of the `TPU` resource. Zero when anything was unreadable or
    /// foreign (fail closed).
    pub chips: u32,
    /// TPU devices counted: `/dev/accelN` entries or VFIO-bound PCI functions; two per chip
    /// on v7x, else one (TPU.md "Generations and chips").
    pub devices: u32,
    /// The generation, from the PCI device id; `Some` whenever `chips > 0`.
    pub generation: Option<TpuGeneration>,
    /// How the chips were found: `"accel"` (character devices `/dev/accelN`), `"vfio"`
    /// (Google PCI devices bound to VFIO), or `"none"` exactly when `chips == 0`.
    pub source: &'static str,
    /// Why: what was counted, or why nothing was (one line, for the agent's log).
    pub reason: String,
}

impl TpuDetection {
    fn none(reason: impl Into<String>) -> TpuDetection {
        TpuDetection {
            chips: 0,
            devices: 0,
            generation: None,
            source: "none",
            reason: reason.into(),
        }
    }
}

/// Detects TPU chips under `root` (`/` on a real host), per TPU.md "Detecting chips on a
/// host". Blocking (reads `root/dev` and `root/sys`); never panics.
///
/// 1. Counts `root/dev/accelN` entries that are character devices. A `dev/accel/`
///    directory (some NVIDIA drivers create one) is not a TPU and is skipped. The generation
///    then comes from the Google TPU PCI devices in `root/sys/bus/pci/devices`; without one
///    (or with mixed generations) the count is zero, since devices per chip are unknown.
/// 2. Otherwise counts PCI devices in `root/sys/bus/pci/devices/*` whose `vendor` is
///    `0x1ae0`, whose `device` is in [`TPU_PCI_DEVICES`] and whose `iommu_group` link name
///    exists under `root/dev/vfio/`. VFIO devices of other vendors are not TPUs.
///
/// Chips = devices / 2 on v7x (two PCI functions per chip), else devices. Zero chips, with
/// [`TpuDetection::reason`] saying why, whenever sysfs (or `root/dev`) cannot be read, a file
/// does not hold a hex id, generations are mixed or v7x devices do not pair up.
pub fn detect_tpus(root: &Path) -> TpuDetection {
    detect_tpus_with(root, is_char_device)
}

/// Real devices are character devices; tests relax this to regular files (they cannot
/// create device nodes).
fn is_char_device(m: &fs::Metadata) -> bool {
    m.file_type().is_char_device()
}

/// [`detect_tpus`] with the test for a device node given (tests accept regular files).
fn detect_tpus_with(root: &Path, is_device: fn(&fs::Metadata) -> bool) -> TpuDetection {
    let dev = root.join("dev");
    let accel = match scan_accel(&dev, is_device) {
        Ok(a) => a,
        Err(reason) => return TpuDetection::none(reason),
    };
    let with_notes = |s: String| {
        if accel.notes.is_empty() { s } else { format!("{s}; {}", accel.notes.join("; ")) }
    };
    let sys_pci = root.join("sys/bus/pci/devices");
    let pci = match scan_pci(&sys_pci) {
        Ok(p) => p,
        Err(reason) => return TpuDetection::none(with_notes(format!("{reason} (fail closed)"))),
    };

    if accel.devices > 0 {
        let tpus: Vec<&PciDevice> = pci.iter().filter(|d| d.generation.is_some()).collect();
        let what = format!("{} character device(s) {}/accelN", accel.devices, dev.display());
        let generation = match single_generation(&tpus, &sys_pci) {
            Ok(g) => g,
            Err(why) => return TpuDetection::none(with_notes(format!("{what} but {why}"))),
        };
        return from_devices("accel", accel.devices, generation, what, with_notes);
    }

    // No `/dev/accelN`: Google TPU PCI devices bound to VFIO.
    let vfio = dev.join("vfio");
    let mut bound = Vec::new();
    let mut unbound = 0;
    let mut foreign = Vec::new();
    let in_vfio = |group: &Option<String>| group.as_ref().is_some_and(|g| vfio.join(g).exists());
    for d in &pci {
        if d.generation.is_some() {
            let group = match iommu_group(&d.path) {
                Ok(g) => g,
                Err(reason) => {
                    return TpuDetection::none(with_notes(format!("{reason} (fail closed)")));
                }
            };
            if in_vfio(&group) {
                bound.push(d);
            } else {
                unbound += 1;
            }
        } else if in_vfio(&iommu_group(&d.path).unwrap_or(None)) {
            // A VFIO device that is not Google's TPU (TPU.md): not counted.
            foreign.push(match d.device {
                Some(id) => format!("{} (vendor 0x{:04x}, device 0x{id:04x})", d.name, d.vendor),
                None => format!("{} (vendor 0x{:04x})", d.name, d.vendor),
            });
        }
    }
    let with_notes = |s: String| {
        let s = if foreign.is_empty() {
            s
        } else {
            format!("{s}; VFIO device(s) that are not Google TPUs ignored: {}", foreign.join(", "))
        };
        with_notes(s)
    };
    if bound.is_empty() {
        let why = if unbound > 0 {
            format!(
                "no {}/accelN character device, and none of the {unbound} Google TPU PCI \
                 device(s) in {} has its iommu_group under {}",
                dev.display(),
                sys_pci.display(),
                vfio.display()
            )
        } else {
            format!(
                "no {}/accelN character device and no Google TPU PCI device (vendor \
                 0x{GOOGLE_PCI_VENDOR:04x}, a device id of TPU.md) bound to VFIO in {}",
                dev.display(),
                sys_pci.display()
            )
        };
        return TpuDetection::none(with_notes(why));
    }
    let what =
        format!("{} Google TPU PCI device(s) bound to VFIO under {}", bound.len(), vfio.display());
    let generation = match single_generation(&bound, &sys_pci) {
        Ok(g) => g,
        Err(why) => return TpuDetection::none(with_notes(format!("{what} but {why}"))),
    };
    from_devices("vfio", bound.len() as u32, generation, what, with_notes)
}

/// Chips from devices of one generation: devices / devices per chip (2 on v7x).
fn from_devices(
    source: &'static str,
    devices: u32,
    generation: TpuGeneration,
    what: String,
    with_notes: impl Fn(String) -> String,
) -> TpuDetection {
    let per = generation.devices_per_chip();
    if !devices.is_multiple_of(per) {
        return TpuDetection::none(with_notes(format!(
            "{what}: {generation} has {per} devices per chip, {devices} do not pair up (fail closed)"
        )));
    }
    let chips = devices / per;
    let reason = with_notes(format!("{chips} {generation} chip(s) from {what}"));
    TpuDetection { chips, devices, generation: Some(generation), source, reason }
}

/// The one generation of these TPU devices; an error saying why there is none (no device,
/// or mixed generations).
fn single_generation(tpus: &[&PciDevice], sys_pci: &Path) -> Result<TpuGeneration, String> {
    let mut gens: Vec<TpuGeneration> = tpus.iter().filter_map(|d| d.generation).collect();
    gens.sort();
    gens.dedup();
    match gens.as_slice() {
        [g] => Ok(*g),
        [] => Err(format!(
            "no Google TPU PCI device (vendor 0x{GOOGLE_PCI_VENDOR:04x}, a device id of TPU.md) \
             in {}, so the generation is unknown (fail closed)",
            sys_pci.display()
        )),
        _ => {
            let names: Vec<String> = gens.iter().map(|g| g.to_string()).collect();
            Err(format!("mixed TPU generations in sysfs: {} (fail closed)", names.join(", ")))
        }
    }
}

/// `root/dev/accelN` character devices, and notes on `accel*` entries skipped.
struct AccelScan {
    devices: u32,
    notes: Vec<String>,
}

fn scan_accel(dev: &Path, is_device: fn(&fs::Metadata) -> bool) -> Result<AccelScan, String> {
    let mut scan = AccelScan { devices: 0, notes: Vec::new() };
    let entries = match fs::read_dir(dev) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(scan),
        Err(e) => return Err(format!("cannot read {}: {e} (fail closed)", dev.display())),
    };
    let mut names = Vec::new();
    for entry in entries {
        let entry =
            entry.map_err(|e| format!("cannot read {}: {e} (fail closed)", dev.display()))?;
        if let Some(name) = entry.file_name().to_str().filter(|n| n.starts_with("accel")) {
            names.push(name.to_string());
        }
    }
    names.sort();
    for name in names {
        let path = dev.join(&name);
        // Follows links: a link to a device node counts as the node.
        let meta = fs::metadata(&path)
            .map_err(|e| format!("cannot stat {}: {e} (fail closed)", path.display()))?;
        let numbered = name.len() > 5 && name[5..].bytes().all(|b| b.is_ascii_digit());
        if meta.is_dir() {
            scan.notes.push(format!(
                "{} is a directory (as some NVIDIA drivers create), not a TPU",
                path.display()
            ));
        } else if numbered && is_device(&meta) {
            scan.devices += 1;
        } else {
            scan.notes
                .push(format!("{} is not a character device accelN, ignored", path.display()));
        }
    }
    Ok(scan)
}

/// One entry of `/sys/bus/pci/devices`.
struct PciDevice {
    /// The PCI address, e.g. `0000:00:04.0`.
    name: String,
    path: PathBuf,
    vendor: u16,
    /// Read for Google devices only.
    device: Option<u16>,
    /// `Some` for Google TPU devices (vendor and device id in [`TPU_PCI_DEVICES`]).
    generation: Option<TpuGeneration>,
}

/// Every PCI device with its vendor (and, for Google's, device id); an error when the
/// folder or any id is unreadable.
fn scan_pci(sys_pci: &Path) -> Result<Vec<PciDevice>, String> {
    let cannot = |e: io::Error| format!("cannot read {}: {e}", sys_pci.display());
    let mut devices = Vec::new();
    for entry in fs::read_dir(sys_pci).map_err(cannot)? {
        let entry = entry.map_err(cannot)?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        let vendor = read_hex_id(&path.join("vendor"))?;
        let (device, generation) = if vendor == GOOGLE_PCI_VENDOR {
            let id = read_hex_id(&path.join("device"))?;
            (Some(id), tpu_generation_for_pci_device(id))
        } else {
            (None, None)
        };
        devices.push(PciDevice { name, path, vendor, device, generation });
    }
    devices.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(devices)
}

/// A sysfs id file such as `vendor`: `0x1ae0` and a newline.
fn read_hex_id(path: &Path) -> Result<u16, String> {
    let s = fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let t = s.trim();
    let hex = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")).unwrap_or(t);
    u16::from_str_radix(hex, 16)
        .map_err(|_| format!("{} holds {t:?}, not a hex PCI id", path.display()))
}

/// The IOMMU group of a PCI device: the name of its `iommu_group` link (`None` when it has
/// none); an error when the entry exists but is not a readable link.
fn iommu_group(device: &Path) -> Result<Option<String>, String> {
    let link = device.join("iommu_group");
    match fs::read_link(&link) {
        Ok(target) => match target.file_name().and_then(|n| n.to_str()) {
            Some(n) => Ok(Some(n.to_string())),
            None => Err(format!("{} links to {}, not a group", link.display(), target.display())),
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("cannot read link {}: {e}", link.display())),
    }
}

/// How long `nvidia-smi` may run before [`detect_gpus`] gives up on it (it can hang on a
/// wedged driver).
pub const NVIDIA_SMI_TIMEOUT: Duration = Duration::from_secs(10);

/// NVIDIA GPUs on this machine (the default of the `GPU` resource): [`detect_gpus_in`] with
/// root `/`.
/// Blocking, up to [`NVIDIA_SMI_TIMEOUT`]; never panics.
pub fn detect_gpus() -> u32 {
    detect_gpus_in(Path::new("/"))
}

/// NVIDIA GPUs, with `root/dev` as the device folder: 0 without any `root/dev/nvidiaN`
/// character device (no driver: `nvidia-smi` is not even started); otherwise the GPUs listed
/// by `nvidia-smi --query-gpu=index --format=csv,noheader` from `PATH`
/// ([`parse_nvidia_smi_index`]), 0 when it is absent, fails, or runs past
/// [`NVIDIA_SMI_TIMEOUT`]. Blocking; never panics.
pub fn detect_gpus_in(root: &Path) -> u32 {
    detect_gpus_with(root, is_char_device, run_nvidia_smi)
}

fn detect_gpus_with(
    root: &Path,
    is_device: fn(&fs::Metadata) -> bool,
    nvidia_smi: impl FnOnce() -> Option<String>,
) -> u32 {
    if count_nvidia_devices(&root.join("dev"), is_device) == 0 {
        return 0;
    }
    nvidia_smi().map(|out| parse_nvidia_smi_index(&out)).unwrap_or(0)
}

/// `dev/nvidiaN` device nodes (not `nvidiactl`, `nvidia-uvm`, ...).
fn count_nvidia_devices(dev: &Path, is_device: fn(&fs::Metadata) -> bool) -> u32 {
    let Ok(entries) = fs::read_dir(dev) else {
        return 0;
    };
    let mut n = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(digits) = name.to_str().and_then(|n| n.strip_prefix("nvidia")) else {
            continue;
        };
        if !digits.is_empty()
            && digits.bytes().all(|b| b.is_ascii_digit())
            && fs::metadata(entry.path()).is_ok_and(|m| is_device(&m))
        {
            n += 1;
        }
    }
    n
}

/// Runs `nvidia-smi --query-gpu=index --format=csv,noheader`; its stdout when it exits 0
/// within [`NVIDIA_SMI_TIMEOUT`], else `None` (killed on timeout).
fn run_nvidia_smi() -> Option<String> {
    use std::io::Read;
    let mut child = Command::new("nvidia-smi")
        .args(["--query-gpu=index", "--format=csv,noheader"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let deadline = Instant::now() + NVIDIA_SMI_TIMEOUT;
    // The output (one short line per GPU) fits in the pipe, so waiting first cannot block it.
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    };
    if !status.success() {
        return None;
    }
    let mut out = String::new();
    child.stdout.take()?.read_to_string(&mut out).ok()?;
    Some(out)
}

/// GPUs in the output of `nvidia-smi --query-gpu=index --format=csv,noheader`: one index
/// per line (`0`, `1`, ...). Blank lines are skipped; any other line (an error message such
/// as `No devices were found`) makes the count 0 (fail closed).
pub fn parse_nvidia_smi_index(output: &str) -> u32 {
    let mut n = 0;
    for line in output.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if line.parse::<u32>().is_err() {
            return 0;
        }
        n += 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_machine_has_cpus_and_memory() {
        assert!(num_cpus() >= 1);
        let (total, avail) = memory_bytes();
        assert!(total > 0 && avail > 0 && avail <= total);
    }

    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A fake `/` (its `dev` and `sys`) in a fresh temp folder, removed on drop.
    struct FakeRoot(PathBuf);

    impl FakeRoot {
        fn new() -> FakeRoot {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let dir =
                std::env::temp_dir().join(format!("tpuray-detect-{}-{n}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            FakeRoot(dir)
        }

        fn path(&self) -> &Path {
            &self.0
        }

        fn file(&self, rel: &str, contents: &str) -> &Self {
            let p = self.0.join(rel);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, contents).unwrap();
            self
        }

        fn dir(&self, rel: &str) -> &Self {
            fs::create_dir_all(self.0.join(rel)).unwrap();
            self
        }

        /// A PCI device as sysfs shows it: `vendor`, `device`, and an `iommu_group` link to
        /// `group` when given.
        fn pci(&self, addr: &str, vendor: u16, device: u16, group: Option<u32>) -> &Self {
            let d = format!("sys/bus/pci/devices/{addr}");
            self.file(&format!("{d}/vendor"), &format!("0x{vendor:04x}\n"));
            self.file(&format!("{d}/device"), &format!("0x{device:04x}\n"));
            if let Some(g) = group {
                let target = format!("../../../../kernel/iommu_groups/{g}");
                std::os::unix::fs::symlink(target, self.0.join(d).join("iommu_group")).unwrap();
            }
            self
        }

        /// `dev/vfio/<group>` (a regular file standing in for the device node).
        fn vfio(&self, group: u32) -> &Self {
            self.file("dev/vfio/vfio", "").file(&format!("dev/vfio/{group}"), "")
        }
    }

    impl Drop for FakeRoot {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// Test-only relaxation: fake device nodes are regular files (no root needed).
    fn fake_device(m: &fs::Metadata) -> bool {
        m.file_type().is_char_device() || m.is_file()
    }

    fn detect(root: &FakeRoot) -> TpuDetection {
        detect_tpus_with(root.path(), fake_device)
    }

    /// A GCE VM's usual extras: a gVNIC (Google vendor, not a TPU) and an Intel bridge.
    fn gce_extras(root: &FakeRoot) {
        root.pci("0000:00:00.0", 0x8086, 0x1237, Some(90)).pci(
            "0000:00:03.0",
            0x1ae0,
            0x0042,
            Some(91),
        );
    }

    /// A v6e-8 host as a TPU VM shows it: `/dev/accel0..7`, eight PCI devices 0x006f.
    fn v6e_accel_host() -> FakeRoot {
        let root = FakeRoot::new();
        gce_extras(&root);
        for i in 0..8 {
            root.file(&format!("dev/accel{i}"), "").pci(
                &format!("0000:00:{:02x}.0", 4 + i),
                0x1ae0,
                0x006f,
                None,
            );
        }
        root
    }

    /// A v4 host whose four chips are bound to VFIO (groups 0..3).
    fn v4_vfio_host() -> FakeRoot {
        let root = FakeRoot::new();
        gce_extras(&root);
        for i in 0..4 {
            root.pci(&format!("0000:00:{:02x}.0", 4 + i), 0x1ae0, 0x005e, Some(i)).vfio(i);
        }
        root
    }

    #[test]
    fn v6e_host_with_eight_accel_devices_has_eight_chips() {
        let d = detect(&v6e_accel_host());
        assert_eq!(
            (d.chips, d.devices, d.generation, d.source),
            (8, 8, Some(TpuGeneration::V6e), "accel"),
            "{d:?}"
        );
        assert!(d.reason.contains("8 v6e chip(s)"), "{}", d.reason);
    }

    #[test]
    fn v4_host_via_vfio_has_four_chips() {
        let d = detect(&v4_vfio_host());
        assert_eq!(
            (d.chips, d.devices, d.generation, d.source),
            (4, 4, Some(TpuGeneration::V4), "vfio"),
            "{d:?}"
        );
    }

    #[test]
    fn real_detection_requires_character_devices_not_regular_files() {
        // The same tree through the public function: regular files are not `/dev/accelN`
        // devices, and without VFIO there is nothing else to count.
        let root = v6e_accel_host();
        let d = detect_tpus(root.path());
        assert_eq!((d.chips, d.source), (0, "none"), "{d:?}");
        assert!(d.reason.contains("not a character device"), "{}", d.reason);
    }

    #[test]
    fn nvidia_accel_folder_is_not_a_tpu() {
        let root = FakeRoot::new();
        root.file("dev/accel/accel0", "").pci("0000:00:05.0", 0x10de, 0x2330, Some(7)).vfio(7);
        let d = detect(&root);
        assert_eq!((d.chips, d.generation, d.source), (0, None, "none"), "{d:?}");
        assert!(d.reason.contains("is a directory"), "{}", d.reason);
    }

    #[test]
    fn non_google_vfio_device_is_not_a_tpu() {
        let root = FakeRoot::new();
        root.pci("0000:00:05.0", 0x10de, 0x2330, Some(3)).vfio(3);
        let d = detect(&root);
        assert_eq!((d.chips, d.source), (0, "none"), "{d:?}");
        assert!(
            d.reason.contains("not Google TPUs ignored: 0000:00:05.0 (vendor 0x10de)"),
            "{}",
            d.reason
        );
    }

    #[test]
    fn non_google_vfio_device_beside_tpus_is_not_counted() {
        let root = v4_vfio_host();
        root.pci("0000:00:10.0", 0x10de, 0x2330, Some(20)).vfio(20);
        let d = detect(&root);
        assert_eq!((d.chips, d.source), (4, "vfio"), "{d:?}");
    }

    #[test]
    fn unreadable_sysfs_counts_zero_chips() {
        // A directory where `vendor` should be a file: structural, so it holds under root.
        let root = v4_vfio_host();
        root.dir("sys/bus/pci/devices/0000:00:10.0/vendor");
        let d = detect(&root);
        assert_eq!((d.chips, d.devices, d.source), (0, 0, "none"), "{d:?}");
        assert!(
            d.reason.contains("cannot read") && d.reason.contains("fail closed"),
            "{}",
            d.reason
        );

        // The same with accel devices: the generation cannot be read, so no chips.
        let root = v6e_accel_host();
        root.dir("sys/bus/pci/devices/0000:00:10.0/vendor");
        assert_eq!(detect(&root).chips, 0);
    }

    #[test]
    fn garbled_or_missing_sysfs_counts_zero_chips() {
        let root = v4_vfio_host();
        root.file("sys/bus/pci/devices/0000:00:04.0/device", "TPU\n");
        let d = detect(&root);
        assert_eq!(d.chips, 0, "{d:?}");
        assert!(d.reason.contains("not a hex PCI id"), "{}", d.reason);

        let root = FakeRoot::new();
        root.file("dev/accel0", "");
        let d = detect(&root);
        assert_eq!(d.chips, 0, "{d:?}");
        assert!(d.reason.contains("cannot read"), "{}", d.reason);
    }

    #[test]
    fn iommu_group_that_is_not_a_link_fails_closed() {
        let root = v4_vfio_host();
        root.pci("0000:00:10.0", 0x1ae0, 0x005e, None)
            .dir("sys/bus/pci/devices/0000:00:10.0/iommu_group");
        let d = detect(&root);
        assert_eq!(d.chips, 0, "{d:?}");
        assert!(d.reason.contains("iommu_group"), "{}", d.reason);
    }

    #[test]
    fn tpu_whose_iommu_group_is_not_under_dev_vfio_is_not_counted() {
        let root = v4_vfio_host();
        root.pci("0000:00:10.0", 0x1ae0, 0x005e, Some(30)); // no dev/vfio/30: not ours
        assert_eq!(detect(&root).chips, 4);

        let root = FakeRoot::new();
        root.pci("0000:00:04.0", 0x1ae0, 0x005e, Some(0));
        let d = detect(&root);
        assert_eq!(d.chips, 0, "{d:?}");
        assert!(d.reason.contains("none of the 1 Google TPU PCI device(s)"), "{}", d.reason);
    }

    #[test]
    fn v7x_counts_two_pci_devices_per_chip() {
        let root = FakeRoot::new();
        gce_extras(&root);
        for i in 0..8 {
            root.pci(&format!("0000:00:{:02x}.{}", 4 + i / 2, i % 2), 0x1ae0, 0x0076, Some(i))
                .vfio(i);
        }
        let d = detect(&root);
        assert_eq!(
            (d.chips, d.devices, d.generation, d.source),
            (4, 8, Some(TpuGeneration::V7x), "vfio"),
            "{d:?}"
        );

        // One more function without its pair: fail closed.
        root.pci("0000:00:10.0", 0x1ae0, 0x0076, Some(8)).vfio(8);
        let d = detect(&root);
        assert_eq!((d.chips, d.source), (0, "none"), "{d:?}");
        assert!(d.reason.contains("do not pair up"), "{}", d.reason);
    }

    #[test]
    fn v7x_accel_devices_count_two_per_chip() {
        let root = FakeRoot::new();
        for i in 0..4 {
            root.file(&format!("dev/accel{i}"), "").pci(
                &format!("0000:00:04.{i}"),
                0x1ae0,
                0x0076,
                None,
            );
        }
        let d = detect(&root);
        assert_eq!((d.chips, d.devices, d.generation), (2, 4, Some(TpuGeneration::V7x)), "{d:?}");
    }

    #[test]
    fn accel_devices_without_a_google_tpu_in_sysfs_count_zero() {
        let root = FakeRoot::new();
        root.file("dev/accel0", "").pci("0000:00:03.0", 0x1ae0, 0x0042, None);
        let d = detect(&root);
        assert_eq!((d.chips, d.source), (0, "none"), "{d:?}");
        assert!(d.reason.contains("generation is unknown"), "{}", d.reason);
    }

    #[test]
    fn mixed_generations_count_zero() {
        let root = v6e_accel_host();
        root.pci("0000:00:10.0", 0x1ae0, 0x0063, None);
        let d = detect(&root);
        assert_eq!(d.chips, 0, "{d:?}");
        assert!(
            d.reason.contains("mixed TPU generations in sysfs: v5litepod, v6e"),
            "{}",
            d.reason
        );
    }

    #[test]
    fn empty_root_has_no_tpus() {
        let root = FakeRoot::new();
        let d = detect(&root);
        assert_eq!((d.chips, d.devices, d.generation, d.source), (0, 0, None, "none"));
        assert!(!d.reason.is_empty());
    }

    #[test]
    fn pci_device_ids_map_to_the_generations_of_tpu_md() {
        for (id, name) in
            [(0x005e, "v4"), (0x0062, "v5p"), (0x0063, "v5e"), (0x006f, "v6e"), (0x0076, "v7x")]
        {
            assert_eq!(tpu_generation_for_pci_device(id), TpuGeneration::parse(name), "{id:#06x}");
        }
        assert_eq!(tpu_generation_for_pci_device(0x0042), None, "gVNIC is not a TPU");
    }

    #[test]
    fn this_machine_detection_never_panics() {
        let d = detect_tpus(Path::new("/"));
        assert_eq!(d.chips == 0, d.source == "none", "{d:?}");
        assert_eq!(d.chips > 0, d.generation.is_some(), "{d:?}");
        let _ = detect_gpus();
    }

    #[test]
    fn nvidia_smi_index_lines_count_gpus() {
        assert_eq!(parse_nvidia_smi_index("0\n1\n2\n3\n4\n5\n6\n7\n"), 8);
        assert_eq!(parse_nvidia_smi_index("0\r\n1\r\n\n"), 2);
        assert_eq!(parse_nvidia_smi_index(""), 0);
    }

    #[test]
    fn nvidia_smi_error_output_counts_zero() {
        assert_eq!(parse_nvidia_smi_index("No devices were found\n"), 0);
        assert_eq!(
            parse_nvidia_smi_index(
                "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"
            ),
            0
        );
        assert_eq!(parse_nvidia_smi_index("0\n[Unknown Error]\n"), 0);
    }

    #[test]
    fn gpus_without_nvidia_device_nodes_skip_nvidia_smi() {
        let root = FakeRoot::new();
        root.file("dev/nvidiactl", "").dir("dev/accel");
        let n = detect_gpus_with(root.path(), fake_device, || panic!("nvidia-smi must not run"));
        assert_eq!(n, 0);
    }

    #[test]
    fn gpus_with_nvidia_device_nodes_count_nvidia_smi_lines() {
        let root = FakeRoot::new();
        root.file("dev/nvidia0", "").file("dev/nvidia1", "").file("dev/nvidiactl", "");
        assert_eq!(detect_gpus_with(root.path(), fake_device, || Some("0\n1\n".into())), 2);
        assert_eq!(
            detect_gpus_with(root.path(), fake_device, || None),
            0,
            "nvidia-smi absent or failed"
        );
        // Real detection requires character devices.
        assert_eq!(detect_gpus_with(root.path(), is_char_device, || Some("0\n".into())), 0);
    }
}
