"""Software-engineering tasks: the model, task files, grading from test output, SWE-bench and
SWE-rebench loaders, difficulty filtering, and a seeded generator of small bug-fixing tasks."""

from orchard.tasks.difficulty import (
    DEFAULT_BUCKETS, bucket_tasks, difficulty_label, filter_by_pass_rate, pass_rate, pass_rates, with_measured_rate,
)
from orchard.tasks.generated import LEVELS, generate_suite, generate_task, heldout_variants
from orchard.tasks.parsers import (
    MISSING, STATUSES, parse_pytest, parse_test_output, parse_unittest, pytest_summary_ok, tests_passed,
    unittest_summary_ok,
)
from orchard.tasks.patches import drop_protected, is_protected, patch_files, split_patch
from orchard.tasks.swebench import (
    Unsupported, instance_image, instance_to_task, load_swebench, load_swerebench, test_directives,
)
from orchard.tasks.task import (
    DEFAULT_PROTECTED_PATHS, Task, TaskFileError, TestFramework, load_tasks, parse_task_line, save_tasks,
)

__all__ = [
    "DEFAULT_BUCKETS", "DEFAULT_PROTECTED_PATHS", "LEVELS", "MISSING", "STATUSES", "Task", "TaskFileError",
    "TestFramework", "Unsupported", "bucket_tasks", "difficulty_label", "drop_protected", "filter_by_pass_rate",
    "generate_suite", "generate_task", "heldout_variants", "instance_image", "instance_to_task", "is_protected",
    "load_swebench", "load_swerebench", "load_tasks", "parse_pytest", "parse_task_line", "parse_test_output",
    "parse_unittest", "pass_rate", "pass_rates", "patch_files", "pytest_summary_ok", "save_tasks", "split_patch",
    "test_directives", "tests_passed", "unittest_summary_ok", "with_measured_rate",
]
