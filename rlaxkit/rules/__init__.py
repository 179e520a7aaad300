"""What the runtime and the simulator share: the rules that shape staleness and lost work.

Plain Python (no JAX, no SimPy), called by the local runtime, the Ray runtime and the
simulator alike: the policies (admission, batching, recovery, weight sync, checkpoints),
the group ledger and its books, the prompt controller, the fault plan and its clock, the
KV-cache page rule, the sampled-vs-trained audit, when a run has stalled, the trace
schema and the validation helpers every config uses.
"""

from __future__ import annotations

from rlaxkit.rules.audit import (
    AuditBook,
    AuditRecord,
    audit_distributions,
    ks_statistic,
    step_audit,
)
from rlaxkit.rules.books import PREEMPTIONS, RunBooks, Window
from rlaxkit.rules.controller import Issue, PromptController
from rlaxkit.rules.fault_clock import FaultState
from rlaxkit.rules.fault_plan import Fault, FaultKind, FaultPlan, InterArrival, random_preemptions
from rlaxkit.rules.ledger import GroupLedger, Ready
from rlaxkit.rules.paging import (
    NULL_PAGE,
    PagePool,
    check_pages,
    pages_for,
    rows_that_fit,
    shared_prompt_pages,
)
from rlaxkit.rules.policies import (
    BatchPolicy,
    CheckpointPolicy,
    DropReason,
    PullMode,
    RecoveryPolicy,
    StalenessPolicy,
    WeightSyncPolicy,
    check_admission,
    policy_from_dict,
    policy_to_dict,
)
from rlaxkit.rules.stalls import (
    TrainingStalled,
    check_start,
    drop_patience,
    drops_error,
    stall_error,
)
from rlaxkit.rules.trace import (
    KINDS,
    REQUIRED_FIELDS,
    GenerationRecord,
    JsonlTraceWriter,
    MemoryTrace,
    TraceEvent,
    TraceSink,
    TraceSummary,
    drop_counts,
    durations,
    generation_records,
    iter_trace,
    read_trace,
    staleness_distribution,
    step_span,
    summarize,
)
from rlaxkit.rules.validation import (
    check_int,
    check_number,
    check_tokenizer_fits,
    is_int,
    is_number,
)

__all__ = [
    "TrainingStalled",
    "check_start",
    "drop_patience",
    "drops_error",
    "stall_error",
    "audit_distributions",
    "AuditBook",
    "AuditRecord",
    "BatchPolicy",
    "check_admission",
    "check_int",
    "check_number",
    "check_pages",
    "check_tokenizer_fits",
    "CheckpointPolicy",
    "drop_counts",
    "DropReason",
    "durations",
    "Fault",
    "FaultKind",
    "FaultPlan",
    "FaultState",
    "generation_records",
    "GenerationRecord",
    "GroupLedger",
    "InterArrival",
    "is_int",
    "is_number",
    "Issue",
    "iter_trace",
    "JsonlTraceWriter",
    "KINDS",
    "ks_statistic",
    "MemoryTrace",
    "NULL_PAGE",
    "PagePool",
    "pages_for",
    "policy_from_dict",
    "policy_to_dict",
    "PREEMPTIONS",
    "PromptController",
    "PullMode",
    "random_preemptions",
    "read_trace",
    "Ready",
    "RecoveryPolicy",
    "REQUIRED_FIELDS",
    "rows_that_fit",
    "RunBooks",
    "shared_prompt_pages",
    "staleness_distribution",
    "StalenessPolicy",
    "step_audit",
    "step_span",
    "summarize",
    "TraceEvent",
    "TraceSink",
    "TraceSummary",
    "WeightSyncPolicy",
    "Window",
]
