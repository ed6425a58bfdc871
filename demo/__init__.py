"""The demo product: a tiny code-completion assistant with simulated users.

A user writes a comment and a function header ("# add 47 to x\\ndef f(x):\\n"); the model completes
the body. Every completion is checked by running its task's tests in a hardened sandbox, and a
simulated user with hidden preferences (correct code, concise one-line house style) reacts with
product signals (accepted, copied, edited, thumbs, ratings, dwell time). Those signals are the
feedback the flywheel learns from; the users' expected satisfaction is the metric it improves.

Modules: `tasks` (task families, known completions, house-style detector), `split` (the fixed
train / gate / report split of the prompts, and the leak check), `sandbox` (runs
untrusted code), `checker` (pass/fail per task; the learner's verifier), `users` (simulated
users), `corpus` (the pre-training corpus mixing good and bad completions): standard library
only. Built on them, with torch: `evaluation` (held-out pass rate and satisfaction), `bootstrap`
(`flywheel bootstrap`), `system` (`flywheel demo`: the whole running system), `report`, and
`loop` (its fast in-process twin).
"""

from demo.checker import CheckResult, DemoVerifier, check, check_batch
from demo.corpus import CorpusMix, format_example, make_corpus
from demo.sandbox import ExecResult, run_functions
from demo.split import SPLITS, find_leaks, sample_tasks, split_of, split_tasks
from demo.tasks import CATEGORIES, FAMILIES, Task, build_task, completions_for, is_preferred_style, task_from_prompt
from demo.users import SIGNAL_KINDS, FeedbackSignal, SimulatedUser, UserPrefs, satisfaction

__all__ = [
    "CATEGORIES",
    "FAMILIES",
    "SIGNAL_KINDS",
    "SPLITS",
    "CheckResult",
    "CorpusMix",
    "DemoVerifier",
    "ExecResult",
    "FeedbackSignal",
    "SimulatedUser",
    "Task",
    "UserPrefs",
    "build_task",
    "check",
    "check_batch",
    "completions_for",
    "format_example",
    "is_preferred_style",
    "make_corpus",
    "find_leaks",
    "run_functions",
    "sample_tasks",
    "satisfaction",
    "split_of",
    "split_tasks",
    "task_from_prompt",
]
