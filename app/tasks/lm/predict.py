"""A language model's batches (jobs.predict): each row's completion of its prompt, or of its
chat messages rendered with the model's chat template, by the decode loop the replicas run
(`predict.generation.max_streams` rows of an actor decoded together, a finished row's place
taken by the next). A row's sampling fields are `predict.generation.sampling` with the row's
own column of the same name over it, read and checked as `/v1/completions` reads its body, so
a greedy or seeded row gets the answer the online endpoint gives it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import typing
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from pydantic import ValidationError

from app.config import Config, ServeConfig
from app.data.checks import MISSING, values_of
from app.errors import UserError
from app.predict.actor import ArtifactBatches, PredictInput, outputs_table
from app.predict.row_checks import CheckedBatch, InputSpec, id_problems, note
from app.runtime.decode_loop import DecodeLoop
from app.runtime.decoding import Generator, PromptError, SamplingParams
from app.runtime.types import RequestError, TokenLogprob
from app.serve.http.protocol import prompt_text, refusal
from app.tasks.lm.chat import from_preprocessor as chat_template
from app.tasks.lm.http.protocol import Message, Sampling

SAMPLING_FIELDS = tuple(Sampling.model_fields)
INTEGER_FIELDS = frozenset(
    n for n, f in Sampling.model_fields.items() if int in typing.get_args(f.annotation)
)


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Settings:
    """What every actor of a run needs beyond the artifact: the config's sampling defaults and
    the bounds `serve.generation` sets on them."""

    sampling: dict[str, Any]
    logprobs: int | None
    max_streams: int
    messages_column: str
    serve: dict[str, Any]

    @classmethod
    def of(cls, config: Config) -> Settings:
        g = config.predict.generation
        serve = config.serve.model_dump(mode="json")
        return cls(g.sampling, g.logprobs, g.max_streams, g.messages_column, serve)


class CompletionPredictor(ArtifactBatches):
    @staticmethod
    def input_spec(request: PredictInput) -> InputSpec:
        """The prompt column, or the messages column when the input has that and no prompts
        (JSON Lines, without a header: either, row by row). Sampling columns are read from
        Parquet and JSON Lines (CSV values are text)."""
        config, fmt, present, id_column = (
            request.config,
            request.format,
            request.present,
            request.id_column,
        )
        g, settings = config.predict.generation, Settings.of(config)
        serve = ServeConfig.model_validate(settings.serve)
        try:
            sampling_params({}, settings, serve)  # the defaults alone, checked up front
        except RequestError as e:
            raise UserError(f"predict.generation.sampling.{e.message}") from None
        columns: tuple[str, ...] = (g.prompt_column,)
        if fmt == "jsonl":
            columns = (g.prompt_column, g.messages_column)
        elif g.messages_column in present and g.prompt_column not in present:
            columns = (g.messages_column,)
        if id_column in columns:
            raise UserError(f"--id-column {id_column!r} is the column of the prompts")
        options = tuple(f for f in SAMPLING_FIELDS if fmt == "jsonl" or f in present)
        options = () if fmt == "csv" else options
        return InputSpec(
            kind=request.schema["kind"],
            feature_columns=columns,
            num_features=1,
            id_column=id_column,
            format=fmt,
            options=options,
            settings=json.dumps(dataclasses.asdict(settings)),
            closed=fmt == "jsonl",
        )

    def __init__(self, artifact_uri: str, variant: str, threads: int, spec: InputSpec):
        super().__init__(artifact_uri, spec)
        self.settings = Settings(**json.loads(spec.settings))
        self.serve = ServeConfig.model_validate(self.settings.serve)
        self.generator = Generator.from_artifact(
            self.artifact,
            variant,
            threads,
            max_prompt_tokens=self.serve.generation.max_prompt_tokens,
        )
        self.chat = chat_template(self.artifact.preprocessor.state)
        self.loop = DecodeLoop(self.generator, model=self.artifact.name)  # one per actor

    def __call__(self, batch: pa.Table) -> pa.Table:
        columns, n, known, where = self.columns(batch)
        reasons: list[str | None] = list(known)
        note(reasons, id_problems(columns[self.spec.id_column], self.spec.id_column))
        read = (*self.spec.feature_columns, *self.spec.options)
        values = {name: values_of(columns[name]) for name in read}
        jobs = {i: self._job(values, i) for i in range(n) if reasons[i] is None}
        note(reasons, {i: job for i, job in jobs.items() if isinstance(job, str)})
        ready = {i: job for i, job in jobs.items() if not isinstance(job, str)}
        answers = dict(zip(ready, self._complete(list(ready.values())), strict=True))
        note(reasons, {i: a.message for i, a in answers.items() if isinstance(a, RequestError)})
        good = np.asarray([i for i, r in enumerate(reasons) if r is None], dtype=np.int64)
        done = [answers[i] for i in good.tolist()]
        checked = CheckedBatch(reasons, None, good)
        outputs = completion_outputs(done, self.settings.logprobs is not None)  # type: ignore[arg-type]
        return outputs_table(columns, self.spec.id_column, checked, outputs, where, self.meta)

    def _job(
        self, values: dict[str, list[Any]], row: int
    ) -> tuple[list[int], SamplingParams] | str:
        """A row's prompt tokens and sampling, or why the row cannot be completed."""
        own = {name: values[name][row] for name in self.spec.options}
        try:
            params = sampling_params(own, self.settings, self.serve)
            prompt, field = self._prompt(values, row)
            chat = field == self.settings.messages_column and self.chat.writes_specials
            return self.generator.encode(prompt, field, special=not chat), params
        except (RequestError, PromptError) as e:  # "<field>: <problem>"
            field, _, problem = (e.message if isinstance(e, RequestError) else str(e)).partition(
                ": "
            )
            return f"column {field!r}: {problem}"

    def _prompt(self, values: dict[str, list[Any]], row: int) -> tuple[str, str]:
        """The row's prompt text and the column it came from (messages rendered)."""
        names = self.spec.feature_columns
        name, value = names[0], values[names[0]][row]
        if value is MISSING and len(names) > 1:  # JSON Lines: a row of messages instead
            name, value = names[1], values[names[1]][row]
        if value is MISSING:
            raise RequestError(400, f"{name}: missing")
        if name == self.settings.messages_column:
            return self.chat.render(_messages(value, name)), name
        try:
            return prompt_text(value.decode() if isinstance(value, bytes) else value), name
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(400, f"{name}: {e}") from None

    def _complete(self, jobs: list[tuple[list[int], SamplingParams]]) -> list[Any]:
        """Every job's Completion (or the RequestError its generation ended with), at most
        max_streams of them in the decode loop at once."""

        async def one(ids: list[int], params: SamplingParams, slots: asyncio.Semaphore) -> Any:
            async with slots:
                stream = self.loop.submit(ids, params)
                texts: list[str] = []
                logprobs: list[TokenLogprob] = []
                try:
                    async for piece in stream:
                        texts.append(piece.text)
                        logprobs += piece.logprobs
                except RequestError as e:
                    return e
                finally:
                    stream.close()
                reason = str(stream.finish_reason)
                tokens = stream.completion_tokens
                return Completion("".join(texts), reason, len(ids), tokens, tuple(logprobs))

        async def run() -> list[Any]:
            slots = asyncio.Semaphore(self.settings.max_streams)
            return await asyncio.gather(*(one(ids, params, slots) for ids, params in jobs))

        return asyncio.run(run()) if jobs else []


def sampling_params(
    values: dict[str, Any], settings: Settings, serve: ServeConfig
) -> SamplingParams:
    """A row's SamplingParams: the config's sampling with the row's own values over it (null or
    absent: the config's), checked as the completions endpoint checks a body."""
    own = {k: column_value(k, v) for k, v in values.items() if v is not MISSING}
    merged = settings.sampling | {k: v for k, v in own.items() if v is not None}
    try:
        sampling = Sampling.model_validate(merged, context={"cfg": serve})
    except ValidationError as e:
        raise refusal(e, Sampling) from None
    return SamplingParams(**sampling.params(serve), logprobs=settings.logprobs)


def column_value(name: str, value: Any) -> Any:
    """A row's value as the endpoint reads it: a NaN is missing, and a whole float in an integer
    field is that integer (pandas writes an integer column with gaps as floats: 8.0); any other
    float there is refused by the field's check, by name."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if name in INTEGER_FIELDS and value.is_integer():
            return int(value)
    return value


def _messages(value: Any, name: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise RequestError(400, f"{name}: expected a non-empty list of {{role, content}} messages")
    out = []
    for i, message in enumerate(value):
        try:
            m = Message.model_validate(message)
        except ValidationError as e:
            raise RequestError(400, f"{name}[{i}].{refusal(e, Message).message}") from None
        out.append({"role": m.role, "content": m.content})
    return out


def completion_outputs(done: list[Completion], with_logprobs: bool) -> dict[str, pa.Array]:
    outputs: dict[str, pa.Array] = {
        "text": pa.array([c.text for c in done], pa.string()),
        "finish_reason": pa.array([c.finish_reason for c in done], pa.string()),
        "prompt_tokens": pa.array([c.prompt_tokens for c in done], pa.int32()),
        "completion_tokens": pa.array([c.completion_tokens for c in done], pa.int32()),
    }
    if with_logprobs:
        outputs["tokens"] = pa.array(
            [[t.token for t in c.logprobs] for c in done], pa.list_(pa.string())
        )
        outputs["token_logprobs"] = pa.array(
            [[t.logprob for t in c.logprobs] for c in done], pa.list_(pa.float64())
        )
    return outputs
