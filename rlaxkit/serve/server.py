"""``ChatEndpoint``: an OpenAI-compatible HTTP server over an ``InferenceEngine``.

aiohttp serves it on a thread of its own (its own event loop), so it starts the same
from a script, a test or a notebook whose loop already runs; the engine runs on another
(``EngineLoop``). Routes:

- ``GET /v1/models``: the one served model.
- ``POST /v1/chat/completions``: OpenAI's request (``messages``, ``tools``,
  ``tool_choice``, ``max_tokens``, ``temperature``, ``n``, ``stop``, ``logprobs``,
  ``seed``); a session id in the ``X-Session-Id`` header or ``extra_body={"session_id":
  ...}`` makes the turn part of a token-exact session (``rlaxkit.serve.sessions``). Each
  choice also carries ``token_ids``, the ids sampled.
- ``POST /v1/sessions``: opens a session (``session_id``, ``group_id``,
  ``sample_index``, ``problem_id``, all optional); returns its ``id``.
- ``POST /v1/sessions/{id}/reward``: ``{"reward": r}`` ends it as a rollout
  (``ChatEndpoint.report`` does the same from Python).

Every refusal is OpenAI's error body with a 4xx status naming the field; an internal
failure is a 500 with a one-line message, never a traceback.

Used from a notebook (a literal block: it needs a model; ``tests/test_serve.py`` runs it)::

    endpoint = ChatEndpoint(model, tokenizer, EndpointConfig()).start()
    client = openai.OpenAI(base_url=endpoint.url, api_key="none")
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np
from aiohttp import web

from rlaxkit.data.rollout import Rollout
from rlaxkit.inference import Completion, InferenceEngine, SamplingConfig
from rlaxkit.inference.engine import WeightSource
from rlaxkit.inference.results import ModelLike
from rlaxkit.models.tokenizer import Tokenizer
from rlaxkit.serve.chat import ChatFormat
from rlaxkit.serve.config import EndpointConfig
from rlaxkit.serve.protocol import ApiError, ChatRequest, error_body, parse_chat_request
from rlaxkit.serve.responses import build_choice
from rlaxkit.serve.scheduler import EngineLoop, QueueFull, Turn
from rlaxkit.serve.sessions import Session, SessionBook, same_message

__all__ = ["ChatEndpoint"]

log = logging.getLogger(__name__)
SESSION_HEADER = "X-Session-Id"
SHUTDOWN_S = 5.0  # how long ``stop`` lets a request still in flight finish


class ChatEndpoint:
    """The endpoint: engine, sessions and the HTTP server (``start``/``stop``).

    Args:
        model: a ``Transformer`` or ``(graphdef, params)``.
        tokenizer: its tokenizer (``rlaxkit.serve.ChatFormat`` renders with it).
        config: what and how it serves.
        weight_source: polled between decode chunks for ``(weights, version)``.
        on_rollout: receives each reported session's ``Rollout``.
        on_drop: receives ``(session, reason)`` for each dropped session.
        version: the version of ``model``'s weights.
    """

    def __init__(
        self,
        model: ModelLike,
        tokenizer: Tokenizer,
        config: EndpointConfig,
        *,
        weight_source: WeightSource | None = None,
        on_rollout: Callable[[Rollout], object] | None = None,
        on_drop: Callable[[Session, str], object] | None = None,
        version: int = 0,
    ):
        self.config, self.tokenizer = config, tokenizer
        self.chat = ChatFormat(tokenizer, template=config.chat_template)
        sampling = SamplingConfig(
            temperature=config.temperature,
            max_new_tokens=config.max_new_tokens,
            stop_tokens=self.chat.stop_tokens,
            stop_sequences=tuple(tuple(tokenizer.encode(text)) for text in config.stop),
        )
        self.engine = InferenceEngine(
            model,
            sampling,
            num_slots=config.slots,
            max_prompt_len=config.max_prompt_tokens,
            version=version,
            chunk_steps=config.chunk_steps,
        )
        self.max_positions = self.engine.model_config.max_position_embeddings
        self.sessions = SessionBook(config.session_timeout_s, on_rollout, on_drop)
        self.weight_source = weight_source
        self.loop: EngineLoop | None = None
        self.url = ""
        self.request_s: list[float] = []  # each answered chat request's wall time
        self._turns = 0
        self._thread: threading.Thread | None = None
        self._asyncio: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._stopping = False

    # -- Python side ----------------------------------------------------------------------
    def start(self) -> ChatEndpoint:
        """Starts the engine thread and the server; ``self.url`` is its ``/v1`` base."""
        if self._thread is not None:
            raise RuntimeError("the endpoint is already started")
        self._stopping = False
        self.loop = EngineLoop(
            self.engine, max_queued=self.config.max_queued, weight_source=self.weight_source
        )
        ready = threading.Event()
        failure: list[BaseException] = []
        self._asyncio = asyncio.new_event_loop()

        def serve() -> None:
            assert self._asyncio is not None
            asyncio.set_event_loop(self._asyncio)
            try:
                self._asyncio.run_until_complete(self._listen())
            except BaseException as error:  # reported to the caller of start
                failure.append(error)
                ready.set()
                return
            ready.set()
            self._asyncio.run_forever()

        self._thread = threading.Thread(target=serve, name="endpoint-http", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self.loop.close()
            raise failure[0]
        return self

    async def _listen(self) -> None:
        app = web.Application(middlewares=[_errors], client_max_size=8 * 2**20)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/sessions", self._open)
        app.router.add_post("/v1/sessions/{id}/reward", self._reward)
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_S
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}/v1"
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        period_s = min(1.0, max(self.config.session_timeout_s / 4, 0.01))
        while True:
            await asyncio.sleep(period_s)
            self.sessions.sweep()

    def stop(self) -> None:
        """Stops the engine thread, then the server; a request still in flight is
        answered 503 (its turn is cancelled), and open sessions are dropped as
        ``"stopped"``. Returns within about ``SHUTDOWN_S`` plus the engine's current
        chunk, whatever the clients do."""
        self._stopping = True
        if self.loop is not None:
            self.loop.close()  # cancels every queued and running turn: handlers return
        if self._asyncio is not None and self._runner is not None:
            future = asyncio.run_coroutine_threadsafe(self._shutdown(), self._asyncio)
            try:
                future.result(timeout=SHUTDOWN_S + 10)
            except concurrent.futures.TimeoutError:
                log.warning("the endpoint's HTTP server did not stop in %.0f s", SHUTDOWN_S + 10)
            self._asyncio.call_soon_threadsafe(self._asyncio.stop)
        if self._thread is not None:
            self._thread.join(timeout=30)
            if not self._thread.is_alive() and self._asyncio is not None:
                self._asyncio.close()
        for sid in list(self.sessions.sessions):
            self.sessions.drop(sid, "stopped")
        self._thread = None
        self._runner = None

    async def _shutdown(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        assert self._runner is not None
        await self._runner.cleanup()  # closes idle keep-alive connections too

    def __enter__(self) -> ChatEndpoint:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def open_session(
        self,
        session_id: str | None = None,
        *,
        group_id: int | None = None,
        sample_index: int = 0,
        problem_id: str = "",
    ) -> str:
        """Opens a session; returns its id (for ``X-Session-Id`` or ``extra_body``)."""
        session = self.sessions.open(
            session_id, group_id=group_id, sample_index=sample_index, problem_id=problem_id
        )
        return session.id

    def report(
        self, session_id: str, reward: float, info: Mapping[str, object] | None = None
    ) -> Rollout:
        """Ends a session with ``reward``: its rollout goes to ``on_rollout``."""
        return self.sessions.report(session_id, reward, info)

    def stats(self) -> dict[str, object]:
        """Sessions open, reported and dropped (by reason), and the engine loop's counts."""
        return {
            "open_sessions": len(self.sessions.sessions),
            "reported": self.sessions.reported,
            "dropped": dict(self.sessions.dropped),
            **(self.loop.snapshot() if self.loop is not None else {}),
        }

    # -- HTTP side ------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        model = {
            "id": self.config.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "rlaxkit",
        }
        return web.json_response({"object": "list", "data": [model]})

    async def _open(self, request: web.Request) -> web.Response:
        body = await _json(request) if request.can_read_body else {}
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        for name, kind in (
            ("session_id", str),
            ("group_id", int),
            ("sample_index", int),
            ("problem_id", str),
        ):
            value = body.get(name)
            if value is not None and (
                not isinstance(value, kind)
                or isinstance(value, bool)
                or (isinstance(value, int) and value < 0)
            ):
                raise ApiError(
                    f"{name}: must be {'a string' if kind is str else 'an integer >= 0'}, "
                    f"got {value!r}",
                    param=name,
                )
        sid = self.open_session(
            body.get("session_id"),
            group_id=body.get("group_id"),
            sample_index=body.get("sample_index") or 0,
            problem_id=body.get("problem_id") or "",
        )
        return web.json_response({"id": sid, "object": "session"})

    async def _reward(self, request: web.Request) -> web.Response:
        body = await _json(request)
        reward = body.get("reward") if isinstance(body, dict) else None
        if (
            isinstance(reward, bool)
            or not isinstance(reward, int | float)
            or not np.isfinite(reward)
        ):
            raise ApiError(f"reward: must be a finite number, got {reward!r}", param="reward")
        info = body.get("info") or {}
        if not isinstance(info, dict):
            raise ApiError(f"info: must be an object, got {info!r}", param="info")
        rollout = self.report(request.match_info["id"], float(reward), info)
        return web.json_response(
            {"id": request.match_info["id"], "reward": rollout.reward, "tokens": rollout.num_tokens}
        )

    async def _chat(self, request: web.Request) -> web.Response:
        began = time.perf_counter()
        chat = parse_chat_request(await _json(request))
        if chat.model != self.config.model_name:
            raise ApiError(
                f"model: {chat.model!r} is not served here; GET /v1/models lists "
                f"{self.config.model_name!r}",
                param="model",
                status=404,
                code="model_not_found",
            )
        if chat.temperature is not None and chat.temperature != self.config.temperature:
            raise ApiError(
                f"temperature: this endpoint samples at {self.config.temperature} (the policy "
                f"being trained); omit it or pass {self.config.temperature}",
                param="temperature",
            )
        budget = chat.max_tokens or self.config.max_new_tokens
        if chat.max_tokens is not None and budget > self.config.max_new_tokens:
            raise ApiError(
                f"max_tokens: at most {self.config.max_new_tokens} per turn here, got {budget}",
                param="max_tokens",
            )
        session_id = request.headers.get(SESSION_HEADER) or chat.session
        if session_id is not None and chat.n != 1:
            raise ApiError("n: a session continues one choice; pass n=1", param="n")
        session = self.sessions.claim(session_id) if session_id is not None else None
        try:
            context, appended = self._context(chat, session)
            if chat.max_tokens is None:  # as OpenAI: the room the context leaves, at most
                budget = max(1, min(budget, self.max_positions - len(context)))
            self._check_room(context, budget)
            completions = await self._sample(context, budget, chat)
            body = self._answer(chat, completions, session, appended)
        finally:
            if session is not None:
                self.sessions.free(session)
        self.request_s.append(time.perf_counter() - began)
        return web.json_response(body)

    def _context(self, chat: ChatRequest, session: Session | None) -> tuple[list[int], list[int]]:
        """The ids the turn follows, and (in a session) the ids appended for the new
        messages; nothing sampled earlier is encoded again."""
        messages = list(chat.messages)
        if session is None or not session.messages:
            ids = self.tokenizer.encode(
                self.chat.render(messages, chat.tools, add_generation_prompt=True)
            )
            if session is not None:
                session.tools = chat.tools
            return ids, []
        kept = session.messages
        if chat.tools != session.tools:
            raise ApiError("tools: must be the session's first request's tools", param="tools")
        if len(messages) <= len(kept):
            raise ApiError(
                f"messages: a session's request repeats its {len(kept)} messages so far and "
                f"adds at least one; got {len(messages)}",
                param="messages",
            )
        for i, (sent, mine) in enumerate(zip(messages, kept, strict=False)):
            if not same_message(sent, mine):
                raise ApiError(
                    f"messages[{i}]: differs from the session's message {i} ({mine['role']}); a "
                    "session only appends messages",
                    param=f"messages[{i}]",
                )
        new = messages[len(kept) :]
        whole = self.chat.render([*kept, *new], chat.tools, add_generation_prompt=True)
        before = self.chat.render(kept, chat.tools, add_generation_prompt=False)
        if not whole.startswith(before):
            raise ApiError(
                "messages: the chat template does not render these messages as an extension "
                "of the session's conversation",
                param="messages",
            )
        last_sampled = [
            t for t, mine in zip(session.tokens, session.policy_mask, strict=True) if mine
        ][-1:]
        appended = self.tokenizer.encode(self.chat.closing(last_sampled) + whole[len(before) :])
        return session.context + appended, appended

    def _check_room(self, context: list[int], budget: int) -> None:
        if len(context) > self.engine.prompt_width:
            raise ApiError(
                f"messages: the conversation is {len(context)} tokens, more than the "
                f"{self.engine.prompt_width} a turn may follow here",
                param="messages",
                code="context_length_exceeded",
            )
        if len(context) + budget > self.max_positions:
            raise ApiError(
                f"max_tokens: {len(context)} tokens of conversation + {budget} new tokens "
                f"exceed the model's context of {self.max_positions}; pass max_tokens <= "
                f"{self.max_positions - len(context)}",
                param="max_tokens",
                code="context_length_exceeded",
            )

    async def _sample(self, context: list[int], budget: int, chat: ChatRequest) -> list[Completion]:
        assert self.loop is not None
        turns = []
        for k in range(chat.n):
            seed = (
                (chat.seed * 1_000_003 + k)
                if chat.seed is not None
                else self.config.seed + self._turns
            )
            self._turns += 1
            try:
                turns.append(self.loop.put(Turn(context, budget, seed % 2**31)))
            except QueueFull as error:
                for turn in turns:
                    turn.future.cancel()
                raise ApiError(
                    f"the endpoint is busy: {error}; retry later",
                    status=429,
                    kind="rate_limit_exceeded",
                ) from None
        futures = [asyncio.wrap_future(t.future) for t in turns]
        try:
            return list(await asyncio.gather(*futures))
        except asyncio.CancelledError:
            for turn in turns:  # the client went away: its queued turns go too
                turn.future.cancel()
            task = asyncio.current_task()
            if self._stopping and task is not None and not task.cancelling():
                raise ApiError(  # the turns were cancelled by ``stop``, not the client
                    "the endpoint is stopping; retry on a running one",
                    status=503,
                    kind="server_error",
                ) from None
            raise

    def _answer(
        self,
        chat: ChatRequest,
        completions: list[Completion],
        session: Session | None,
        appended: list[int],
    ) -> dict[str, object]:
        """The response body; in a session, the turn is recorded on it."""
        choices = []
        for index, completion in enumerate(completions):
            choice, kept, ids = build_choice(
                self.tokenizer, chat, completion, index, call_id=f"call_{self._turns}_{index}"
            )
            choices.append(choice)
            if session is not None:  # n == 1: the one choice continues the session
                if not session.messages:
                    session.prompt_ids = completion.prompt_tokens.tolist()
                session.add_appended(appended)
                session.add_sampled(
                    ids,
                    completion.logprobs[: len(ids)].tolist(),
                    completion.versions[: len(ids)].tolist(),
                )
                session.messages = [*chat.messages, kept]
                session.turns += 1
                session.last_finish = "length" if choice["finish_reason"] == "length" else "stop"
        prompt_tokens = int(completions[0].prompt_tokens.size)
        sampled = sum(len(c["token_ids"]) for c in choices)
        body: dict[str, object] = {
            "id": f"chatcmpl-{self._turns}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.config.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": sampled,
                "total_tokens": prompt_tokens + sampled,
            },
        }
        if session is not None:
            body["session"] = {"id": session.id, "appended_ids": appended, "turns": session.turns}
        return body


async def _json(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as error:
        raise ApiError(f"the request body is not valid JSON: {error}") from None


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every refusal as OpenAI's error body; an unexpected failure as a one-line 500."""
    try:
        return await handler(request)
    except ApiError as error:
        return web.json_response(error_body(error), status=error.status)
    except web.HTTPException as error:  # unknown route or method
        refusal = ApiError(f"{request.method} {request.path}: {error.reason}", status=error.status)
        return web.json_response(error_body(refusal), status=error.status)
    except Exception as error:
        log.exception("endpoint request failed")
        refusal = ApiError(
            f"internal error ({type(error).__name__}); the server log has the details",
            status=500,
            kind="server_error",
        )
        return web.json_response(error_body(refusal), status=500)
