"""Stop a run whose answers cannot become ids: reasoning sent back for a completion format without reasoning.

A format without a reasoning section (`completion_format: auto` derives one from a template that never renders
reasoning: SmolLM3, MiMo-VL, Ministral-3-Reasoning, Granite-3.3 with thinking on) cannot hold an answer that has
reasoning: each such row fails at reconstruct, after it was paid for. When the first answers of a run all carry
reasoning, the format is wrong for this model, and every later answer would be bought to be thrown away. A model
that reasons only sometimes is not stopped: its rows with reasoning fail one by one, as validation reports.
"""

from __future__ import annotations

from tasks.common.errors import ConfigError

FIRST_ANSWERS = 16
"""Answers that must all carry reasoning before the run stops: enough that a hybrid model's occasional reasoning
does not stop it, few enough that a 2,000-in-flight run has bought little it cannot use."""


class UnexpectedReasoning:
    """Watches the answers of one run, in the order they are recorded. Event-loop confined."""

    def __init__(self, format_has_reasoning: bool, format_name: str) -> None:
        self.watching = not format_has_reasoning
        self.format_name = format_name
        self.with_reasoning = 0

    def see(self, reasoning: str | None) -> None:
        """Raises `ConfigError` once the first `FIRST_ANSWERS` answers all carried reasoning."""
        if not self.watching:
            return
        if not reasoning or reasoning.isspace():
            self.watching = False
            return
        self.with_reasoning += 1
        if self.with_reasoning >= FIRST_ANSWERS:
            self.watching = False
            raise ConfigError(
                f"the first {FIRST_ANSWERS} answers all carry reasoning, but tokenizer.completion_format "
                f"({self.format_name}) has no reasoning section, so no answer can be rebuilt into the ids the model "
                "emitted; stopped before buying more (what was answered is kept). Use a format with reasoning for "
                "this model (a preset, or the format written out under tokenizer.completion_format: reasoning_open, "
                "reasoning_close, reasoning_pad, content_separator, end_of_turn), or turn its thinking off "
                "(tokenizer.chat_template_kwargs, sent to the server too)"
            )
