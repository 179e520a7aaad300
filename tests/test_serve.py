"""The OpenAI-compatible endpoint, driven by the real ``openai`` client over 127.0.0.1.

One tiny random Qwen3-shaped model and the fixtures' byte-level BPE tokenizer (ChatML
markers as special tokens) serve every test; the engine compiles once for the module.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import numpy as np
import openai
import pytest
from flax import nnx
from openai.types.chat import ChatCompletion

from rlaxkit.data.buffer import RolloutBuffer
from rlaxkit.data.rollout import ENVIRONMENT_VERSION
from rlaxkit.inference import Completion
from rlaxkit.models import ModelConfig, Transformer, load_tokenizer
from rlaxkit.rules.policies import StalenessPolicy
from rlaxkit.serve import (
    SESSION_HEADER,
    ChatEndpoint,
    EndpointConfig,
    parse_assistant,
    parse_chat_request,
    qwen_chat,
)

FIXTURE = "tests/fixtures/hf/qwen3"
MAX_NEW = 12


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(FIXTURE)


@pytest.fixture(scope="module")
def endpoint(tokenizer):
    config = ModelConfig(
        family="qwen3",
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=1024,
    )
    rollouts: list = []
    served = ChatEndpoint(
        Transformer(config, rngs=nnx.Rngs(0)),
        tokenizer,
        EndpointConfig(max_new_tokens=MAX_NEW, max_prompt_tokens=512, slots=4, chunk_steps=4),
        on_rollout=rollouts.append,
    )
    served.rollouts = rollouts  # type: ignore[attr-defined]
    with served:
        assert served.url.startswith("http://127.0.0.1:")
        yield served


@pytest.fixture()
def client(endpoint):
    return openai.OpenAI(base_url=endpoint.url, api_key="unused", max_retries=0)


def settled(endpoint) -> None:
    """No turn queued or in a row, no session marked busy (waits a little for turns
    whose clients went away)."""
    for _ in range(200):
        if not endpoint.loop.queue and not endpoint.loop.running:
            break
        time.sleep(0.05)
    assert not endpoint.loop.queue and not endpoint.loop.running and endpoint.engine.idle
    assert not any(s.busy for s in endpoint.sessions.sessions.values())


def test_public_surface():
    import rlaxkit.serve

    for name in rlaxkit.serve.__all__:
        assert getattr(rlaxkit.serve, name) is not None, name


def test_models_lists_the_one_served_model(client):
    assert [m.id for m in client.models.list().data] == ["rlaxkit"]


def test_three_turn_session_trains_on_the_sampled_ids_not_a_re_encoding(
    endpoint, client, tokenizer
):
    sid = endpoint.open_session(group_id=100)
    messages: list[dict] = [{"role": "user", "content": "What is 12 + 7?"}]
    sampled, returned_logprobs, appended = [], [], []
    for turn in range(3):
        response = client.chat.completions.create(
            model="rlaxkit",
            messages=messages,
            logprobs=True,
            extra_headers={SESSION_HEADER: sid} if turn % 2 else None,
            extra_body=None if turn % 2 else {"session_id": sid},
        )
        choice = response.choices[0]
        ids = choice.model_extra["token_ids"]
        sampled.append(ids)
        returned_logprobs.append([c.logprob for c in choice.logprobs.content])
        appended.append(response.model_extra["session"]["appended_ids"])
        messages.append(choice.message.model_dump(exclude_none=True))
        if turn < 2:
            messages.append({"role": "user", "content": f"Now add {turn + 1}."})
    endpoint.report(sid, 1.0)
    (rollout,) = [r for r in endpoint.rollouts if r.group_id == 100]

    # The appended ids, worked out by hand from ChatML: the turn's closing (the model's
    # own <|im_end|> when it sampled one), the user turn, the next generation prompt.
    im_end = tokenizer.encode("<|im_end|>")[0]
    expected = tokenizer.encode(
        "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n"
    )
    for turn in range(3):
        expected += sampled[turn]
        if turn < 2:
            closing = "\n" if sampled[turn][-1] == im_end else "<|im_end|>\n"
            text = f"{closing}<|im_start|>user\nNow add {turn + 1}.<|im_end|>\n"
            ids = tokenizer.encode(text + "<|im_start|>assistant\n")
            assert appended[turn + 1] == ids
            expected += ids
    row = rollout.prompt_tokens.tolist() + rollout.completion_tokens.tolist()
    assert row == expected

    # Only the sampled ids are in the loss, with the log-probs the client was given.
    mask = rollout.policy_mask
    assert rollout.completion_tokens[mask].tolist() == sum(sampled, [])
    assert rollout.behaviour_logprobs[mask].tolist() == sum(returned_logprobs, [])
    assert (rollout.behaviour_logprobs[~mask] == 0).all()
    assert (rollout.versions[~mask] == ENVIRONMENT_VERSION).all()
    assert (rollout.versions[mask] == 0).all()
    assert rollout.reward == 1.0 and rollout.reward_info["turns"] == 3

    # The naive row: the whole chat re-rendered and re-encoded. BPE merges the sampled
    # pieces back into its own tokens, so it is not what was sampled.
    naive = tokenizer.encode(qwen_chat(messages, add_generation_prompt=False))
    assert naive != row
    merged = [tokenizer.encode(tokenizer.decode(ids)) != ids for ids in sampled]
    assert any(merged)
    settled(endpoint)


def test_tools_render_in_qwen_layout_and_tool_calls_parse_back(endpoint, client, tokenizer):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "calc",
                "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
            },
        }
    ]
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "calc", "arguments": json.dumps({"expression": "12*7"})},
    }
    messages = [
        {"role": "user", "content": "12*7?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "84"},
    ]
    response = client.chat.completions.create(
        model="rlaxkit", messages=messages, tools=tools, max_tokens=4
    )
    parsed = [{**m, "content": m["content"] or ""} for m in messages]
    parsed[1]["tool_calls"] = [
        {**call, "function": {"name": "calc", "arguments": {"expression": "12*7"}}}
    ]
    text = qwen_chat(parsed, tools, add_generation_prompt=True)
    assert (
        '<tool_call>\n{"name": "calc", "arguments": {"expression": "12*7"}}\n</tool_call>' in text
    )
    assert "<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>" in text
    assert json.dumps(tools[0]) in text
    assert response.usage.prompt_tokens == len(tokenizer.encode(text))

    # The assistant turn as the template wrote it reads back as the same call.
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert parse_assistant(turn) == ("", [("calc", {"expression": "12*7"})])
    assert parse_assistant("I will add.\n<tool_call>\nnot json\n</tool_call>") == (
        "I will add.\n<tool_call>\nnot json\n</tool_call>",
        [],
    )
    settled(endpoint)


def test_a_sampled_tool_call_round_trips_through_the_client(endpoint, client, tokenizer):
    """A turn sampled as a Qwen tool call (given here as its ids: the tiny random model
    writes none) comes back as ``tool_calls`` the client parses; the client sends it back
    with the tool's result, and the session appends exactly the tool turn's ids."""
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    messages = [{"role": "user", "content": "12*7?"}]
    im_end = tokenizer.encode("<|im_end|>")[0]
    sid = endpoint.open_session()
    session = endpoint.sessions.claim(sid)
    chat = parse_chat_request({"model": "rlaxkit", "messages": messages, "tools": tools})
    prompt, _ = endpoint._context(chat, session)
    call = '<tool_call>\n{"name": "calc", "arguments": {"expression": "12*7"}}\n</tool_call>'
    ids = [*tokenizer.encode(call), im_end]
    sampled = Completion(
        request_id=0,
        sample_index=0,
        prompt_tokens=np.asarray(prompt, np.int32),
        tokens=np.asarray(ids, np.int32),
        logprobs=np.full(len(ids), -0.5, np.float32),
        plain_logprobs=np.full(len(ids), -0.5, np.float32),
        versions=np.zeros(len(ids), np.int32),
        finish_reason="stop",
    )
    body = endpoint._answer(chat, [sampled], session, [])
    endpoint.sessions.free(session)

    reply = ChatCompletion.model_validate(body).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    (tool_call,) = reply.message.tool_calls
    assert tool_call.function.name == "calc"
    assert json.loads(tool_call.function.arguments) == {"expression": "12*7"}
    messages += [
        reply.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": tool_call.id, "content": "84"},
    ]
    response = client.chat.completions.create(
        model="rlaxkit",
        messages=messages,
        tools=tools,
        max_tokens=2,
        extra_headers={SESSION_HEADER: sid},
    )
    appended = response.model_extra["session"]["appended_ids"]
    assert appended == tokenizer.encode(
        "\n<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    rollout = endpoint.report(sid, 1.0)
    row = rollout.prompt_tokens.tolist() + rollout.completion_tokens.tolist()
    assert row == prompt + ids + appended + response.choices[0].model_extra["token_ids"]
    settled(endpoint)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "rlaxkit", "messages": [{"role": "user", "content": "x"}], "n": "2"}, 400, "n"),
        ({"model": "rlaxkit", "messages": "hi"}, 400, "messages"),
        (
            {"model": "rlaxkit", "messages": [{"role": "robot", "content": "x"}]},
            400,
            "messages[0].role",
        ),
        ({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
        (
            {
                "model": "rlaxkit",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 10**6,
            },
            400,
            "max_tokens",
        ),
        (
            {
                "model": "rlaxkit",
                "messages": [{"role": "user", "content": "x"}],
                "temperature": 0.3,
            },
            400,
            "temperature",
        ),
        (
            {
                "model": "rlaxkit",
                "messages": [{"role": "user", "content": "x"}],
                "session_id": "nope",
            },
            404,
            "session_id",
        ),
        (
            {"model": "rlaxkit", "messages": [{"role": "user", "content": "x" * 3000}]},
            400,
            "messages",
        ),
    ],
)
def test_bad_requests_get_openai_errors_naming_the_field(endpoint, body, status, param):
    response = httpx.post(f"{endpoint.url}/chat/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param.split("[")[0])
    assert "Traceback" not in response.text
    settled(endpoint)


def test_malformed_json_and_unknown_routes_are_4xx_with_error_bodies(endpoint, client):
    response = httpx.post(
        f"{endpoint.url}/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    assert httpx.get(f"{endpoint.url}/nowhere", timeout=30).status_code == 404
    with pytest.raises(openai.NotFoundError, match="session_id"):
        client.chat.completions.create(
            model="rlaxkit",
            messages=[{"role": "user", "content": "x"}],
            extra_headers={SESSION_HEADER: "never-opened"},
        )
    reward = httpx.post(
        f"{endpoint.url}/sessions/never-opened/reward", json={"reward": 1}, timeout=30
    )
    assert reward.status_code == 404 and reward.json()["error"]["param"] == "session_id"
    settled(endpoint)


def test_a_session_must_repeat_its_history_and_may_not_report_before_a_turn(endpoint, client):
    sid = httpx.post(f"{endpoint.url}/sessions", json={}, timeout=30).json()["id"]
    with pytest.raises(openai.ConflictError, match="no turn was sampled"):
        _reward(endpoint, sid)
    first = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(model="rlaxkit", messages=first, extra_body={"session_id": sid})
    edited = [{"role": "user", "content": "bye"}, {"role": "assistant", "content": "?"}, *first]
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]: differs"):
        client.chat.completions.create(
            model="rlaxkit", messages=edited, extra_body={"session_id": sid}
        )
    assert endpoint.sessions.sessions[sid].turns == 1
    _reward(endpoint, sid, 0.5)
    settled(endpoint)


def _reward(endpoint, sid, reward=1.0):
    response = httpx.post(
        f"{endpoint.url}/sessions/{sid}/reward", json={"reward": reward}, timeout=30
    )
    if response.status_code != 200:
        raise openai.ConflictError(
            response.json()["error"]["message"], response=response, body=None
        )
    return response.json()


def test_many_sessions_at_once_become_one_group_in_the_buffer(endpoint, tokenizer):
    buffer = RolloutBuffer(StalenessPolicy(max_staleness=1, batch_size=1), group_size=6)
    buffer.issue(200, "sum")
    endpoint.sessions.on_rollout = lambda rollout: buffer.add(rollout, trainer_version=0)
    sids = [endpoint.open_session(group_id=200, sample_index=j, problem_id="sum") for j in range(6)]

    def agent(sid: str) -> None:  # an agent written against the openai client only
        client = openai.OpenAI(base_url=endpoint.url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Add 2 and 3."}]
        for _ in range(2):
            reply = client.chat.completions.create(
                model="rlaxkit", messages=messages, extra_headers={SESSION_HEADER: sid}
            )
            messages += [reply.choices[0].message.model_dump(exclude_none=True)]
            messages += [{"role": "user", "content": "Check it."}]
        httpx.post(
            f"{endpoint.url}/sessions/{sid}/reward", json={"reward": int(sid[-1]) % 2}, timeout=30
        )

    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            list(pool.map(agent, sids))
    finally:
        endpoint.sessions.on_rollout = endpoint.rollouts.append
    (group,) = buffer.take_batch(trainer_version=1)
    assert group.group_id == 200 and [r.sample_index for r in group.rollouts] == list(range(6))
    assert all(r.reward_info["turns"] == 2 for r in group.rollouts)
    settled(endpoint)


def test_a_silent_session_times_out_and_a_lost_client_leaves_no_row(endpoint, client):
    sid = endpoint.open_session()
    client.chat.completions.create(
        model="rlaxkit", messages=[{"role": "user", "content": "x"}], extra_body={"session_id": sid}
    )
    before = endpoint.sessions.dropped["timeout"]
    later = time.monotonic() + endpoint.config.session_timeout_s + 1
    assert sid in endpoint.sessions.sweep(now_s=later)
    assert endpoint.sessions.dropped["timeout"] == before + 1
    with pytest.raises(openai.NotFoundError, match="dropped: timeout"):
        client.chat.completions.create(
            model="rlaxkit",
            messages=[{"role": "user", "content": "x"}],
            extra_body={"session_id": sid},
        )

    # Clients that send their requests and go away at once: their turns leave the
    # queue, or their rows at the next chunk boundary (or were answered before the
    # server saw them go); every turn is accounted for, no row stays taken, and the
    # session one of them was in is free again.
    sid = endpoint.open_session()
    before = endpoint.loop.snapshot()
    timeout = httpx.Timeout(5.0, read=0.005)

    def impatient(k: int) -> bool:
        body = {"model": "rlaxkit", "messages": [{"role": "user", "content": f"x{k}"}]}
        if k == 0:
            body["session_id"] = sid
        try:
            response = httpx.post(f"{endpoint.url}/chat/completions", json=body, timeout=timeout)
        except httpx.ReadTimeout:
            return True
        assert response.status_code == 200
        return False

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        went_away = sum(pool.map(impatient, range(8)))

    def accounted() -> tuple[int, int]:
        counts = {k: n - before.get(k, 0) for k, n in endpoint.loop.snapshot().items()}
        dropped = sum(
            counts.get(k, 0) for k in ("cancelled_in_queue", "cancelled_running", "discarded")
        )
        return dropped, dropped + counts.get("completed", 0)

    # A request whose client went away may reach the server's handler late on a busy
    # machine: wait (a bounded while) until each is accounted for.
    deadline = time.monotonic() + 30.0
    while accounted()[1] < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    settled(endpoint)
    dropped, total = accounted()
    assert total == 8
    assert went_away >= dropped and went_away >= 1


def test_a_client_gone_while_its_turn_runs_frees_the_row_at_the_next_chunk():
    """The engine loop alone: one row, a turn of 400 tokens running, a second queued. The
    first's client goes away: its row is freed at the next chunk boundary (not after its
    400 tokens) and the second turn gets it."""
    from rlaxkit.inference import InferenceEngine, SamplingConfig
    from rlaxkit.serve.scheduler import EngineLoop, Turn

    config = ModelConfig(
        family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    engine = InferenceEngine(
        Transformer(config, rngs=nnx.Rngs(0)),
        SamplingConfig(temperature=1.0, max_new_tokens=400),
        num_slots=1,
        max_prompt_len=8,
        chunk_steps=2,
    )
    loop = EngineLoop(engine, max_queued=4)
    try:
        long = loop.put(Turn(context=[1, 2, 3], budget=400, seed=0))
        deadline = time.monotonic() + 60.0
        while engine.num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        short = loop.put(Turn(context=[4, 5], budget=4, seed=1))
        assert long.future.cancel()  # the client went away mid-turn
        completion = short.future.result(timeout=60.0)
        assert completion.num_tokens == 4
        counts = loop.snapshot()
        assert counts["cancelled_running"] == 1 and counts["completed"] == 1
        assert "discarded" not in counts
    finally:
        loop.close()


def test_stop_answers_a_request_in_flight_503_even_when_the_engine_thread_is_stuck(tokenizer):
    """The engine thread is held inside a weight pull (as on a slow parameter server) with
    a client's turn queued: ``stop`` cancels the turn itself, the client is answered 503
    naming the stop, and the server's loop is closed (nothing left for the collector)."""
    import threading

    config = ModelConfig(
        family="qwen3", vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
        num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    stuck, release = threading.Event(), threading.Event()

    def weights():
        stuck.set()
        release.wait(60.0)
        return None

    served = ChatEndpoint(
        Transformer(config, rngs=nnx.Rngs(0)),
        tokenizer,
        EndpointConfig(max_new_tokens=MAX_NEW, max_prompt_tokens=512, slots=1),
        weight_source=weights,
    ).start()
    client = openai.OpenAI(base_url=served.url, api_key="unused", max_retries=0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            client.chat.completions.create,
            model="rlaxkit",
            messages=[{"role": "user", "content": "hi"}],
        )
        assert stuck.wait(60.0)
        timer = threading.Timer(2.0, release.set)  # the pull ends later, during stop
        timer.start()
        served.stop()
        timer.join()
        with pytest.raises(openai.InternalServerError) as refused:
            pending.result(timeout=60.0)
    assert refused.value.status_code == 503
    assert "stopping" in refused.value.message
    assert served._asyncio is not None and served._asyncio.is_closed()
    client.close()
