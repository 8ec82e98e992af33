//! The metrics' label sets and the outcomes they name: each a bounded set of values (never a
//! subject).

use prometheus_client::encoding::EncodeLabelSet;

use ratelimit_wire::{ErrorCode, RequestAnswer};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// The limit's (rule's or override's) name.
    pub limit: String,
    /// See [`CountedAs`].
    pub verdict: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    /// `http` (`POST /v1/decide`) or `grpc` (Envoy's rate limit service).
    pub api: &'static str,
    /// See [`CallOutcome`].
    pub outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: &'static str,
}

/// What became of one settlement (`ratelimit_settlements_total{outcome}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettleOutcome {
    /// The real cost was above the reservation: the difference charged (past zero).
    Charged,
    /// The real cost was below it: the difference given back.
    GivenBack,
    /// A repeat of a batch already applied: nothing changed.
    Repeated,
    /// Nothing to settle: the cost equal to what was charged, a cost below a reservation no
    /// receipt shows, or no bucket (an unknown, unlimited or blocked rule, a regional share of 0
    /// or not under lease).
    Skipped,
    /// The store could not apply it (the caller may retry the batch).
    Failed,
}

impl SettleOutcome {
    pub const ALL: [SettleOutcome; 5] = [
        SettleOutcome::Charged,
        SettleOutcome::GivenBack,
        SettleOutcome::Repeated,
        SettleOutcome::Skipped,
        SettleOutcome::Failed,
    ];

    pub fn label(self) -> &'static str {
        match self {
            SettleOutcome::Charged => "charged",
            SettleOutcome::GivenBack => "given_back",
            SettleOutcome::Repeated => "repeated",
            SettleOutcome::Skipped => "skipped",
            SettleOutcome::Failed => "failed",
        }
    }
}

/// What became of a concurrency slot (`ratelimit_slots_total{rule, outcome}`,
/// docs/concurrency.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotOutcome {
    /// Taken by an admitted request.
    Taken,
    /// Refused: the set held `concurrency` slots (the request answered 429).
    Full,
    /// Held longer by a gateway's renewal.
    Renewed,
    /// Given back: the stream ended, or the request's rate limit rejected it after the take.
    Released,
    /// A renewal or release of a slot the set no longer held (it expired) or never held.
    ExpiredOrUnknown,
}

impl SlotOutcome {
    pub const ALL: [SlotOutcome; 5] = [
        SlotOutcome::Taken,
        SlotOutcome::Full,
        SlotOutcome::Renewed,
        SlotOutcome::Released,
        SlotOutcome::ExpiredOrUnknown,
    ];

    pub fn label(self) -> &'static str {
        match self {
            SlotOutcome::Taken => "taken",
            SlotOutcome::Full => "full",
            SlotOutcome::Renewed => "renewed",
            SlotOutcome::Released => "released",
            SlotOutcome::ExpiredOrUnknown => "expired_or_unknown",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SlotLabels {
    /// The limit's (rule's or override's) name.
    pub rule: String,
    /// See [`SlotOutcome`].
    pub outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StrategyLabels {
    pub strategy: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReadLabels {
    /// `whole` (within `--max-body-bytes`) or `split` (sent on as several reports).
    pub read: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RuleLabels {
    /// `<domain>/<rule>`, a name from the policy.
    pub rule: String,
}

/// What a decision was counted as: the `verdict` label of `ratelimit_decisions_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CountedAs {
    /// Admitted and charged.
    Allowed,
    /// The bucket refused.
    Rejected,
    /// A shadow-mode limit refused (the request was not rejected for it).
    ShadowRejected,
    /// The bucket could pay, but another decision of the request rejected: not charged.
    NotCharged,
    /// An unlimited override: admitted without counting.
    Unlimited,
    /// A blocking override: refused without counting.
    Blocked,
}

impl CountedAs {
    pub(super) fn label(self) -> &'static str {
        match self {
            CountedAs::Allowed => "allowed",
            CountedAs::Rejected => "rejected",
            CountedAs::ShadowRejected => "shadow_rejected",
            CountedAs::NotCharged => "not_charged",
            CountedAs::Unlimited => "unlimited",
            CountedAs::Blocked => "blocked",
        }
    }
}

/// How one gateway request ended: the `outcome` label of `ratelimit_requests_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestOutcome {
    Allowed,
    Rejected,
    UnknownRule,
    Unavailable,
    Error,
}

impl RequestOutcome {
    /// Every outcome, in declaration order (`outcome as usize` indexes it).
    pub const ALL: [RequestOutcome; 5] = [
        RequestOutcome::Allowed,
        RequestOutcome::Rejected,
        RequestOutcome::UnknownRule,
        RequestOutcome::Unavailable,
        RequestOutcome::Error,
    ];

    /// The outcome of one request's answer.
    pub fn of(answer: &RequestAnswer) -> RequestOutcome {
        match &answer.error {
            None if answer.allowed => RequestOutcome::Allowed,
            None => RequestOutcome::Rejected,
            Some(e) => match e.code {
                ErrorCode::UnknownRule => RequestOutcome::UnknownRule,
                ErrorCode::Unavailable => RequestOutcome::Unavailable,
                ErrorCode::ScriptFailed => RequestOutcome::Error,
            },
        }
    }

    pub(super) fn label(self) -> &'static str {
        match self {
            RequestOutcome::Allowed => "allowed",
            RequestOutcome::Rejected => "rejected",
            RequestOutcome::UnknownRule => "unknown_rule",
            RequestOutcome::Unavailable => "unavailable",
            RequestOutcome::Error => "error",
        }
    }
}

/// How one call ended: the `outcome` label of `ratelimit_calls_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallOutcome {
    /// Answered (each request has its verdict or its own error).
    Answered,
    BadRequest,
    Unauthorized,
    /// Every request failed because Redis was unavailable (503).
    Unavailable,
    /// The script failed (500).
    Error,
}

impl CallOutcome {
    pub(super) fn label(self) -> &'static str {
        match self {
            CallOutcome::Answered => "answered",
            CallOutcome::BadRequest => "bad_request",
            CallOutcome::Unauthorized => "unauthorized",
            CallOutcome::Unavailable => "unavailable",
            CallOutcome::Error => "error",
        }
    }
}
