//! vLLM's `medium` strings to Dynamo's storage tiers, without regard to case.

/// Where a block is resident, fastest first. The discriminants index per-tier tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    Device = 0,
    HostPinned = 1,
    Disk = 2,
    External = 3,
}

impl Tier {
    pub const ALL: [Tier; 4] = [Tier::Device, Tier::HostPinned, Tier::Disk, Tier::External];

    /// The name of the tier in Dynamo's vocabulary (`kvbridge.Tier`'s values).
    pub fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::HostPinned => "host_pinned",
            Tier::Disk => "disk",
            Tier::External => "external",
        }
    }

    /// The medium the canonical stream names the tier with, one Dynamo knows.
    pub fn medium(self) -> &'static str {
        match self {
            Tier::Device => "GPU",
            Tier::HostPinned => "CPU",
            Tier::Disk => "DISK",
            Tier::External => "EXTERNAL",
        }
    }
}

/// Every medium kvbridge understands, upper case. `FS` and `OBJ` are vLLM 0.26.0's names for
/// what later releases call `STORAGE`; Mooncake and LMCache send lower-case `cpu`.
pub const MEDIA: [(&str, Tier); 16] = [
    ("", Tier::Device),
    ("GPU", Tier::Device),
    ("DEVICE", Tier::Device),
    ("CPU", Tier::HostPinned),
    ("CPU_PINNED", Tier::HostPinned),
    ("CPU_TIER1", Tier::HostPinned),
    ("DISK", Tier::Disk),
    ("NVME", Tier::Disk),
    ("STORAGE", Tier::Disk),
    ("FS", Tier::Disk),
    ("OBJ", Tier::Disk),
    ("CPU_TIER2", Tier::Disk),
    ("EXTERNAL", Tier::External),
    ("NETWORK", Tier::External),
    ("REMOTE", Tier::External),
    ("SHARED", Tier::External),
];

fn lookup(medium: &str) -> Option<Tier> {
    MEDIA
        .iter()
        .find(|(name, _)| *name == medium)
        .map(|(_, tier)| *tier)
}

/// The tier of a medium (none means the GPU), or `None` for a medium nobody defined. Case is
/// folded the way Python's `str.upper` folds it (full Unicode mapping).
pub fn tier_for_medium(medium: Option<&str>) -> Option<Tier> {
    let Some(medium) = medium else {
        return Some(Tier::Device);
    };
    lookup(medium).or_else(|| lookup(&medium.to_uppercase()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn media_fold_case_as_python_does() {
        assert_eq!(tier_for_medium(None), Some(Tier::Device));
        assert_eq!(tier_for_medium(Some("cpu")), Some(Tier::HostPinned));
        // U+017F LATIN SMALL LETTER LONG S upper-cases to "S", in Python as here.
        assert_eq!(tier_for_medium(Some("\u{17f}hared")), Some(Tier::External));
        assert_eq!(tier_for_medium(Some("tape")), None);
    }
}
