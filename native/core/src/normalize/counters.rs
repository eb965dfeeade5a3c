//! What a normalizer counts: blocks forwarded, and those not forwarded by reason.

use crate::media::Tier;

/// Why a block (or a clear) was not forwarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    UnknownMedium = 0,
    RemoteLocality,
    UnknownLocality,
    NonMainGroup,
    BlockSizeMismatch,
    OrphanParent,
    UnresolvedPlaceholder,
    DuplicateStore,
    StillReferenced,
    UnknownBlock,
    ClearedEarlier,
    StateCap,
}

impl DropReason {
    pub const ALL: [DropReason; 12] = [
        DropReason::UnknownMedium,
        DropReason::RemoteLocality,
        DropReason::UnknownLocality,
        DropReason::NonMainGroup,
        DropReason::BlockSizeMismatch,
        DropReason::OrphanParent,
        DropReason::UnresolvedPlaceholder,
        DropReason::DuplicateStore,
        DropReason::StillReferenced,
        DropReason::UnknownBlock,
        DropReason::ClearedEarlier,
        DropReason::StateCap,
    ];

    /// The reason's name in `kvbridge.DropReason` and the metrics.
    pub fn name(self) -> &'static str {
        match self {
            DropReason::UnknownMedium => "unknown_medium",
            DropReason::RemoteLocality => "remote_locality",
            DropReason::UnknownLocality => "unknown_locality",
            DropReason::NonMainGroup => "non_main_group",
            DropReason::BlockSizeMismatch => "block_size_mismatch",
            DropReason::OrphanParent => "orphan_parent",
            DropReason::UnresolvedPlaceholder => "unresolved_placeholder",
            DropReason::DuplicateStore => "duplicate_store",
            DropReason::StillReferenced => "still_referenced",
            DropReason::UnknownBlock => "unknown_block",
            DropReason::ClearedEarlier => "cleared_earlier",
            DropReason::StateCap => "state_cap",
        }
    }
}

/// What an event did: the first index of the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Stored = 0,
    Removed = 1,
    Cleared = 2,
}

impl Action {
    pub fn name(self) -> &'static str {
        match self {
            Action::Stored => "stored",
            Action::Removed => "removed",
            Action::Cleared => "cleared",
        }
    }
}

/// Blocks forwarded and not forwarded. A drop's tier index 4 means the tier is unknown.
#[derive(Debug, Clone, Default)]
pub struct Counters {
    /// By action and tier; a clear counts once per tier.
    pub forwarded: [[u64; 4]; 3],
    /// By action (stored, removed), tier (or 4: unknown) and reason.
    pub dropped: [[[u64; 12]; 5]; 2],
    pub unknown_fields: u64,
    /// State given up to stay within the [`Limits`]: ranks forgotten (and cleared
    /// downstream), blocks evicted (and removed downstream), context-table compactions.
    pub evicted_ranks: u64,
    pub evicted_blocks: u64,
    pub context_compactions: u64,
    /// Blocks announced again after a loss because a store named them as its ancestors.
    pub reanchored_blocks: u64,
}

/// Caps on the state one normalizer may hold, whatever its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Ranks tracked; a new rank past it forgets the least recently used one (cleared
    /// downstream, so nothing stays stale).
    pub max_ranks: usize,
    /// Live blocks over every rank; past it the oldest blocks of the rank being written are
    /// evicted (removed downstream).
    pub max_blocks: usize,
    /// Distinct (LoRA name, cache salt) pairs; past it the unused ones are forgotten, and a
    /// store that would need one more is dropped (`state_cap`).
    pub max_contexts: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_ranks: 1024,
            max_blocks: 4_000_000,
            max_contexts: 65_536,
        }
    }
}

/// A reason dropped for the first time, for the one log line it deserves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FirstDrop {
    pub reason: DropReason,
    pub action: Action,
    pub tier: Option<Tier>,
    pub medium: Option<String>,
}
