"""Sandboxed coding environments: sandboxes, tools, tasks and datasets, grading."""

from environments.grading import collect_files, grade, setup_workspace
from environments.sandbox import BACKENDS, Sandbox, SandboxLimits, make_sandbox, task_sandbox_options
from environments.tasks import SHIPPED_TASKS, TaskSet, load_tasks, task_from_record
from environments.tools import TOOL_NAMES, TOOL_SPECS, Observation, execute_tool, truncate_middle
from environments.types import ExecResult, GradeResult, Task, TaskFile, ToolCall

__all__ = [
    "collect_files", "grade", "setup_workspace", "BACKENDS", "Sandbox", "SandboxLimits", "make_sandbox",
    "task_sandbox_options", "SHIPPED_TASKS",
    "TaskSet", "load_tasks", "task_from_record", "TOOL_NAMES", "TOOL_SPECS", "Observation", "execute_tool",
    "truncate_middle", "ExecResult", "GradeResult", "Task", "TaskFile", "ToolCall",
]
