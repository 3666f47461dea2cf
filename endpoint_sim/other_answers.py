"""Answers somebody other than the target wrote, each as long (in target tokens) as the target's own answer.

The control arm of the real-model demo: a drafter trained on these learns from the target's hidden states over
text the target did not choose, with the same number of answer tokens per prompt as the drafter trained on the
target's own answers, so the two differ only in who wrote the answers. The text is English prose by people:
the docstrings of Python's standard library (shipped with every interpreter, nothing downloaded), read in a fixed
order and cut into consecutive windows, one per prompt.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

from endpoint_sim.model_backend import ModelResponder
from endpoint_sim.responder import Responder, SimConfig, SimSample, unit_hash

CORPUS_MODULES = (
    "argparse",
    "asyncio",
    "collections",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "email",
    "fractions",
    "functools",
    "heapq",
    "http.client",
    "inspect",
    "itertools",
    "json",
    "logging",
    "pathlib",
    "pickle",
    "random",
    "re",
    "shutil",
    "socket",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib.parse",
    "zipfile",
)


def stdlib_prose() -> str:
    """Docstrings of the modules above and their public classes and functions, paragraphs joined by blank lines."""
    seen: set[str] = set()
    paragraphs = []
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        objects = [module, *(getattr(module, attr) for attr in sorted(vars(module)) if not attr.startswith("_"))]
        for obj in objects:
            doc = (
                inspect.getdoc(obj)
                if inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isfunction(obj)
                else None
            )
            if doc and len(doc) > 80 and doc not in seen:
                seen.add(doc)
                paragraphs.append(doc.strip())
    return "\n\n".join(paragraphs)


class OtherAnswersResponder(Responder):
    """For each prompt: a window of the corpus with as many tokens as `own`'s answer to the same prompt."""

    def __init__(
        self,
        model_dir: Path | str,
        config: SimConfig,
        own: ModelResponder,
        corpus: str | None = None,
        limit: int | None = None,
    ) -> None:
        """`limit`: the token limit the runs ask for (`sampling.max_tokens`), so `own`'s answers, decoded up to
        that limit, serve as they are instead of being decoded again up to the backend's own cap."""
        super().__init__(model_dir, config)
        self.own = own
        self.limit = limit
        self.corpus_ids = self._encode(corpus if corpus is not None else stdlib_prose())

    def _build(self, key: str, prompt_ids: tuple[int, ...]) -> SimSample:
        own = self.own.sample(prompt_ids, None, key, limit=self.limit)
        n = len(own.output_ids) - (1 if own.finished else 0)
        room = max(1, len(self.corpus_ids) - n)
        start = int(unit_hash(key, self.config.seed, "other-window") * room)
        text = self.decode(self.corpus_ids[start : start + n])
        body = self._encode(text)
        output = (*body, self.eos_id) if own.finished else body
        return SimSample(
            key=key,
            prompt_ids=prompt_ids,
            reasoning="",
            content=text,
            output_ids=output,
            canonical_ids=output,
            reasoning_tokens=0,
            provider=own.provider,
            has_tool_call=False,
            noncanonical=False,
            text_mismatch=False,
            has_reasoning=False,
            finished=own.finished,
        )
