"""clairvoyant.prediction.dialects: the one place deciding the text a request is featurized from."""

from __future__ import annotations

import json

import pytest

from clairvoyant.errors import BadRequest
from clairvoyant.prediction.dialects import SCHEDULED_ENDPOINTS, parse_request, prompt_from_body
from clairvoyant.prediction.features import FEATURE_SETS, Prompt

CHAT = SCHEDULED_ENDPOINTS["/v1/chat/completions"]
COMPLETION = SCHEDULED_ENDPOINTS["/v1/completions"]
OLLAMA_CHAT = SCHEDULED_ENDPOINTS["/api/chat"]
OLLAMA_GENERATE = SCHEDULED_ENDPOINTS["/api/generate"]


def test_all_four_endpoints_are_scheduled() -> None:
    assert set(SCHEDULED_ENDPOINTS) == {"/v1/chat/completions", "/v1/completions", "/api/chat", "/api/generate"}


def test_openai_chat_uses_last_user_turn_and_counts_history_and_system() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "You are terse."},  # 14
            {"role": "user", "content": "first question"},  # 14
            {"role": "assistant", "content": "an answer"},  # 9
            {"role": "user", "content": "Write an essay"},  # 14
        ]
    }
    p = prompt_from_body(CHAT, body)
    assert p == Prompt("Write an essay", context_chars=14 + 14 + 9 + 14, turns=4, system_chars=14)


def test_openai_chat_list_of_parts_joins_text_and_skips_images() -> None:
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Describe"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    {"type": "text", "text": "this picture"},
                ],
            }
        ]
    }
    p = prompt_from_body(CHAT, body)
    assert p.instruction == "Describe\nthis picture"
    assert p.turns == 1 and p.system_chars == 0


def test_openai_chat_developer_role_counts_as_system_and_last_user_wins_even_if_not_last() -> None:
    body = {
        "messages": [
            {"role": "developer", "content": "rules"},
            {"role": "user", "content": "question"},
            {"role": "assistant", "content": "partial answer"},  # a prefill after the user turn
        ]
    }
    p = prompt_from_body(CHAT, body)
    assert p.instruction == "question" and p.system_chars == 5 and p.turns == 3


@pytest.mark.parametrize(
    "messages",
    [
        [],
        None,
        "not a list",
        [None, 3, "x"],
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": {"weird": True}}],
        [{"content": "no role"}],
        [{"role": "user", "content": [1, None, {}]}],
    ],
)
def test_openai_chat_odd_messages_give_an_empty_instruction(messages: object) -> None:
    p = prompt_from_body(CHAT, {"messages": messages})
    assert p.instruction == ""
    for fs in FEATURE_SETS.values():
        assert fs.extract(p).shape == (fs.size,)


def test_openai_completion_string_list_and_token_ids() -> None:
    assert prompt_from_body(COMPLETION, {"prompt": "Once upon"}) == Prompt("Once upon", 9, 1, 0)
    p = prompt_from_body(COMPLETION, {"prompt": ["a", "bc"]})
    assert p.instruction == "a\nbc" and p.context_chars == 4
    ids = prompt_from_body(COMPLETION, {"prompt": [1, 2, 3]})
    assert ids.instruction == "" and ids.context_chars == 12  # 4 characters a token
    nested = prompt_from_body(COMPLETION, {"prompt": [[1, 2], [3]]})
    assert nested.context_chars == 12
    assert prompt_from_body(COMPLETION, {"prompt": None}).instruction == ""
    assert prompt_from_body(COMPLETION, {}).instruction == ""


def test_ollama_chat_and_generate() -> None:
    chat = prompt_from_body(
        OLLAMA_CHAT,
        {"model": "m", "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello there"}]},
    )
    assert chat == Prompt("hello there", context_chars=14, turns=2, system_chars=3)
    gen = prompt_from_body(OLLAMA_GENERATE, {"model": "m", "prompt": "Why?", "system": "Be brief"})
    assert gen == Prompt("Why?", context_chars=12, turns=1, system_chars=8)
    # Ollama's system must be a string; anything else is ignored.
    assert prompt_from_body(OLLAMA_GENERATE, {"model": "m", "prompt": "x", "system": 5}).system_chars == 0
    assert prompt_from_body(OLLAMA_GENERATE, {"model": "m"}).instruction == ""


@pytest.mark.parametrize(
    "text",
    ["", "\x00\x01\x02\x1b[0m", "日本語で答えてください", "\ud83d", "x" * 1_000_000, "🙂" * 1000],
)
def test_odd_text_passes_through_unchanged_for_every_endpoint(text: str) -> None:
    assert prompt_from_body(CHAT, {"messages": [{"role": "user", "content": text}]}).instruction == text
    assert prompt_from_body(COMPLETION, {"prompt": text}).instruction == text
    assert (
        prompt_from_body(OLLAMA_CHAT, {"model": "m", "messages": [{"role": "user", "content": text}]}).instruction
        == text
    )
    assert prompt_from_body(OLLAMA_GENERATE, {"model": "m", "prompt": text}).context_chars == len(text)


def test_parse_request_refuses_what_it_cannot_read_and_reads_the_rest() -> None:
    with pytest.raises(BadRequest):
        parse_request(CHAT, b"{not json")
    with pytest.raises(BadRequest):
        parse_request(CHAT, b"[1, 2]")
    with pytest.raises(BadRequest, match="messages"):
        parse_request(CHAT, b'{"messages": []}')
    with pytest.raises(BadRequest, match="prompt"):
        parse_request(COMPLETION, b'{"prompt": 5}')
    with pytest.raises(BadRequest, match="model"):
        parse_request(OLLAMA_GENERATE, b'{"prompt": "x"}')
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "\u0000 hi \ud83d"}]}).encode()
    parsed = parse_request(OLLAMA_CHAT, raw)
    assert parsed.stream is True  # Ollama streams by default
    assert parsed.prompt.instruction == "\u0000 hi \ud83d"
    assert parsed.forward_body == raw


def test_proxy_field_removal_survives_a_lone_surrogate() -> None:
    raw = b'{"messages": [{"role": "user", "content": "hi \\ud83d"}], "clairvoyant": {"x": 1}}'
    parsed = parse_request(CHAT, raw)
    assert parsed.proxy_options == {"x": 1}
    assert json.loads(parsed.forward_body)["messages"][0]["content"] == "hi \ud83d"


def test_ollama_context_ids_count_as_history_and_non_object_messages_do_not_count_as_turns() -> None:
    generate = parse_request(
        OLLAMA_GENERATE, json.dumps({"model": "m", "prompt": "go on", "context": [1, 2, 3]}).encode()
    )
    assert generate.prompt.context_chars == len("go on") + 4 * 3
    chat = parse_request(
        OLLAMA_CHAT, json.dumps({"model": "m", "messages": ["junk", {"role": "user", "content": "hi"}]}).encode()
    )
    assert chat.prompt.turns == 1 and chat.prompt.instruction == "hi"


# --------------------------------------------------------------------------------------------
# The output cap

from clairvoyant.prediction.dialects import Dialect, cap_tokens_from_body  # noqa: E402


@pytest.mark.parametrize(
    ("body", "cap"),
    [
        ({}, None),
        ({"max_tokens": 64}, 64),
        ({"max_completion_tokens": 32}, 32),
        ({"n_predict": 16}, 16),  # llama.cpp's own field
        ({"max_tokens": 64, "max_completion_tokens": 32, "n_predict": 100}, 32),  # the tightest bound wins
        ({"max_tokens": 0}, 0),
        ({"n_predict": -1}, None),  # llama.cpp: -1 = unlimited
        ({"max_tokens": -1, "n_predict": 8}, 8),
        ({"max_tokens": 50.0}, 50),  # an integral float is that integer
        ({"max_tokens": 50.5}, None),  # the wrong types are ignored, not refused
        ({"max_tokens": "50"}, None),
        ({"max_tokens": True}, None),
        ({"max_tokens": None}, None),
        ({"max_tokens": [5]}, None),
        ({"options": {"num_predict": 7}}, None),  # Ollama's field means nothing to the OpenAI dialect
    ],
)
def test_openai_caps(body: dict, cap: int | None) -> None:
    assert cap_tokens_from_body(Dialect.OPENAI, body) == cap


@pytest.mark.parametrize(
    ("body", "cap"),
    [
        ({"options": {"num_predict": 7}}, 7),
        ({"options": {"num_predict": -1}}, None),  # Ollama: negative = unlimited
        ({"options": {"num_predict": -2}}, None),  # Ollama: -2 = fill the context
        ({"options": {"num_predict": "7"}}, None),
        ({"options": [7]}, None),
        ({"options": None}, None),
        ({"max_tokens": 5}, None),  # not an Ollama field
    ],
)
def test_ollama_caps(body: dict, cap: int | None) -> None:
    assert cap_tokens_from_body(Dialect.OLLAMA, body) == cap


def test_parse_request_reads_the_cap_and_never_refuses_a_cap_of_the_wrong_type() -> None:
    chat = {"messages": [{"role": "user", "content": "Write an essay"}]}
    assert parse_request(CHAT, json.dumps({**chat, "max_tokens": 1}).encode()).cap_tokens == 1
    assert parse_request(CHAT, json.dumps(chat).encode()).cap_tokens is None
    assert parse_request(CHAT, json.dumps({**chat, "max_tokens": "lots"}).encode()).cap_tokens is None
    assert parse_request(COMPLETION, b'{"prompt": "x", "n_predict": 12, "max_tokens": 40}').cap_tokens == 12
    assert (
        parse_request(OLLAMA_GENERATE, b'{"model": "m", "prompt": "x", "options": {"num_predict": 9}}').cap_tokens == 9
    )
    assert (
        parse_request(OLLAMA_CHAT, b'{"model": "m", "messages": [], "options": {"num_predict": -1}}').cap_tokens is None
    )


def test_requests_naming_one_model_share_its_name() -> None:
    """A waiting request holds its model's name: requests that name the same model share one
    string (interned), not a copy each."""
    chat = SCHEDULED_ENDPOINTS["/v1/chat/completions"]
    name = "".join(["llama3.2:3b-", "instruct-q4_K_M"])  # built at run time: not a constant already interned
    bodies = [json.dumps({"model": name, "messages": [{"role": "user", "content": f"q{i}"}]}).encode() for i in (1, 2)]
    first, second = (parse_request(chat, body).model for body in bodies)
    assert first == second == name and first is second
