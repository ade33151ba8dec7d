"""Context compaction (docs/ALGORITHMS.md §2): the summary request and the rebuilt context.

Compaction is an environment transition. The policy writes a handoff note (its tokens are trained); the next
segment starts from system + task + note + the last atomic steps, all loss mask 0, including the copied note.
"""

from __future__ import annotations

from rollout.chat import Message

SUMMARY_INSTRUCTION = (
    "You are about to lose the earlier part of this session; only your note below, the system prompt and the "
    "last steps will remain. Write a handoff note for yourself that lets you continue without redoing work. "
    "Include, in this order: (1) the goal and acceptance criteria in your own words; (2) facts you established: "
    "file paths, how to run the tests, commands that worked; (3) every change made so far and whether it was "
    "verified; (4) what failed, with the exact key error lines; (5) the next concrete steps. Keep identifiers, "
    "paths and error strings exact. Do not claim progress that was not verified. Do not call tools. Stay under "
    "{budget} tokens. Output only the note."
)
RESUME_PREAMBLE = (
    "The earlier history was compacted. Continue the same task from the note below; treat the tool outputs "
    "that follow as the current state and do not repeat completed work.\n\nNote:\n"
)


def atomic_steps(messages: list[Message]) -> list[list[Message]]:
    """Group a history into steps: one assistant message and every message up to the next one."""
    steps: list[list[Message]] = []
    for m in messages:
        if m.role == "assistant" or not steps:
            steps.append([m])
        else:
            steps[-1].append(m)
    return [s for s in steps if s[0].role == "assistant"]


def rebuilt_context(system: Message, task: Message | None, summary: str, recent: list[list[Message]]) -> list[Message]:
    head = [system] + ([task] if task is not None else [])
    note = Message("user", RESUME_PREAMBLE + summary.strip())
    return head + [note] + [m for step in recent for m in step]


def shrink_largest_observation(messages: list[Message]) -> bool:
    """Halve the longest tool observation (head + tail kept). Used only on the summary request's temporary
    copy of the history; the live history and the ledger are never edited. False when nothing is left to cut."""
    candidates = [i for i, m in enumerate(messages) if m.role == "tool" and len(m.content) > 200]
    if not candidates:
        return False
    i = max(candidates, key=lambda j: len(messages[j].content))
    text = messages[i].content
    keep = len(text) // 4
    messages[i] = Message("tool", f"{text[:keep]}\n[... truncated for the summary ...]\n{text[-keep:]}")
    return True
