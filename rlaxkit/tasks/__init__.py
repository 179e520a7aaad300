"""Tasks with verifiable rewards, user datasets, the reward runner and dataset curation.

>>> from rlaxkit.tasks import make_task
>>> task = make_task("arithmetic", max_digits=2)
>>> problem = task.problems("train", 1)[0]
>>> task.score(problem, task.demonstration(problem)).score
1.0
"""

from rlaxkit.tasks.arithmetic import ArithmeticConfig, ArithmeticTask
from rlaxkit.tasks.base import (
    CPU_TIME_LIMIT,
    FORBIDDEN_OPERATION,
    INVALID_EXPRESSION,
    INVALID_REWARD,
    MEMORY_LIMIT,
    NO_ANSWER,
    NUMBER_MISUSE,
    OUTPUT_LIMIT,
    REWARD_CRASHED,
    REWARD_ERROR,
    REWARD_TIMEOUT,
    RUNTIME_ERROR,
    TESTS_FAILED,
    WALL_TIMEOUT,
    WRONG_ANSWER,
    ChatTemplate,
    Problem,
    PromptConfig,
    RewardResult,
    Split,
    Task,
    demonstrations,
    format_prompt,
    split_of,
    stable_id,
)
from rlaxkit.tasks.code import CodeConfig, CodeTask, extract_code, outputs_match
from rlaxkit.tasks.countdown import CountdownConfig, CountdownTask, check_solution
from rlaxkit.tasks.curation import (
    CurationConfig,
    CurationResult,
    PassRate,
    curate,
    dedup,
    estimate_pass_rates,
    filter_by_pass_rate,
    holdout_split,
    normalise_text,
    order_by_difficulty,
    write_curated,
)
from rlaxkit.tasks.datasets import (
    DatasetError,
    FieldMapping,
    LoadedDataset,
    load_problems,
    write_problems,
)
from rlaxkit.tasks.expressions import ExpressionError, evaluate_expression
from rlaxkit.tasks.math_answers import (
    MathConfig,
    MathTask,
    answers_match,
    extract_answer,
    extract_boxed,
)
from rlaxkit.tasks.policy import TextPolicy, sample_and_score
from rlaxkit.tasks.registry import make_task, register_task, task_config_class, task_names
from rlaxkit.tasks.runner import RewardRunner, RewardRunnerConfig, validate_reward
from rlaxkit.tasks.sandbox import SandboxLimits, SandboxResult, run_python

__all__ = [
    "CPU_TIME_LIMIT",
    "FORBIDDEN_OPERATION",
    "INVALID_EXPRESSION",
    "INVALID_REWARD",
    "MEMORY_LIMIT",
    "NO_ANSWER",
    "NUMBER_MISUSE",
    "OUTPUT_LIMIT",
    "REWARD_CRASHED",
    "REWARD_ERROR",
    "REWARD_TIMEOUT",
    "RUNTIME_ERROR",
    "TESTS_FAILED",
    "WALL_TIMEOUT",
    "WRONG_ANSWER",
    "ArithmeticConfig",
    "ArithmeticTask",
    "ChatTemplate",
    "CodeConfig",
    "CodeTask",
    "CountdownConfig",
    "CountdownTask",
    "CurationConfig",
    "CurationResult",
    "DatasetError",
    "ExpressionError",
    "FieldMapping",
    "LoadedDataset",
    "MathConfig",
    "MathTask",
    "PassRate",
    "Problem",
    "PromptConfig",
    "RewardResult",
    "RewardRunner",
    "RewardRunnerConfig",
    "SandboxLimits",
    "SandboxResult",
    "Split",
    "Task",
    "TextPolicy",
    "answers_match",
    "check_solution",
    "curate",
    "dedup",
    "demonstrations",
    "estimate_pass_rates",
    "evaluate_expression",
    "extract_answer",
    "extract_boxed",
    "extract_code",
    "filter_by_pass_rate",
    "format_prompt",
    "holdout_split",
    "load_problems",
    "make_task",
    "normalise_text",
    "order_by_difficulty",
    "outputs_match",
    "register_task",
    "run_python",
    "sample_and_score",
    "split_of",
    "stable_id",
    "task_config_class",
    "task_names",
    "validate_reward",
    "write_curated",
    "write_problems",
]
