"""The Ray integration's plain parts: adverts, prompt tokens, engine arguments, worker ids."""

from __future__ import annotations

import subprocess
import sys
from array import array
from types import SimpleNamespace

import pytest
import structlog

pytest.importorskip("ray.serve")

from kvbridge.adapters.ports import free_port_range
from kvbridge.ray_integration import (
    ROUTING_STATS_KEY,
    KVEventPorts,
    KVEventsAdvert,
    engine_env,
    find_routing_state,
    read_advert,
    vllm_engine_kwargs,
    worker_id_for,
)
from kvbridge.ray_integration.kv_router import replica_groups
from kvbridge.ray_integration.prompt import (
    load_tokenizer,
    prompt_lora_name,
    prompt_tokens,
)
from kvbridge.ray_integration.routing_states import close_routing_states, routing_state

PORTS = KVEventPorts(engine=30000, engine_replay=30002, relay=30004, relay_replay=30006, dp_size=2)


def test_core_does_not_import_ray() -> None:
    code = (
        "import sys, kvbridge, kvbridge.adapters.relay, kvbridge.cli; print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_worker_id_is_blake2b_of_the_replica_id() -> None:
    # BLAKE2b-64 of "pp78ozrl", big-endian: the id Ray Serve LLM's own KV router derives.
    assert worker_id_for("pp78ozrl") == int.from_bytes(
        __import__("hashlib").blake2b(b"pp78ozrl", digest_size=8).digest(), "big"
    )
    assert worker_id_for("pp78ozrl") == worker_id_for("pp78ozrl") != worker_id_for("pp78ozrm")
    assert 0 <= worker_id_for("x") < 2**64


def test_advert_round_trips_through_routing_stats() -> None:
    advert = KVEventsAdvert(
        endpoints={0: "tcp://10.0.0.5:30004", 1: "tcp://10.0.0.5:30005"},
        replay_endpoints={0: "tcp://10.0.0.5:30006", 1: "tcp://10.0.0.5:30007"},
        block_size=32,
    )
    stats = advert.routing_stats()
    assert list(stats) == [ROUTING_STATS_KEY]
    assert read_advert(stats) == advert
    assert advert.dp_ranks == [0, 1]
    assert read_advert({}) is None
    assert read_advert(None) is None
    assert read_advert({"other": 1}) is None


def test_ray_llm_metadata_is_read_as_a_raw_stream() -> None:
    stats = {
        "kv_event_metadata": {
            "endpoint": "tcp://10.0.0.5:5557",
            "replay_endpoint": "tcp://10.0.0.5:6557",
            "block_size": 16,
            "dp_rank": 0,
            "max_num_batched_tokens": 8192,
        }
    }
    assert read_advert(stats) == KVEventsAdvert(
        endpoints={0: "tcp://10.0.0.5:5557"},
        replay_endpoints={0: "tcp://10.0.0.5:6557"},
        block_size=16,
        canonical=False,
    )


@pytest.mark.parametrize(
    ("advert", "message"),
    [
        (
            {"endpoints": {}, "block_size": 16},
            "invalid KV-events advert: endpoints must name at least one dp rank",
        ),
        (
            {"endpoints": {0: "tcp://a:1"}, "block_size": 0},
            "invalid KV-events advert: block_size must be positive, got 0",
        ),
        (
            {"endpoints": {0: "tcp://a:1"}},
            "invalid KV-events advert: Object missing required field `block_size`",
        ),
        (
            {"endpoints": {0: "tcp://a:1"}, "block_size": 16, "color": "red"},
            "invalid KV-events advert: Object contains unknown field `color`",
        ),
    ],
)
def test_invalid_advert_says_why(advert: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as error:
        read_advert({ROUTING_STATS_KEY: advert})
    assert str(error.value) == message


def test_prompt_tokens_from_kwargs_and_bodies() -> None:
    assert prompt_tokens((), {"prompt_token_ids": [1, 2, 3]}) == array("I", [1, 2, 3])
    assert prompt_tokens((), {"token_ids": (4, 5)}) == array("I", [4, 5])
    assert prompt_tokens(({"prompt": [7, 8]},), {}) == array("I", [7, 8])
    assert prompt_tokens((SimpleNamespace(prompt_token_ids=[9]),), {}) == array("I", [9])
    assert prompt_tokens(({"prompt": "hello"},), {}) is None  # text needs a tokenizer
    assert prompt_tokens((), {}) is None
    assert prompt_tokens((), {"prompt_token_ids": []}) is None
    assert prompt_tokens((), {"prompt_token_ids": [1, -1]}) is None  # not u32
    assert prompt_tokens((), {"prompt_token_ids": [1, 2**32]}) is None
    assert prompt_tokens((), {"prompt_token_ids": [1, 2.5]}) is None
    assert prompt_tokens((), {"prompt_token_ids": [1, "2"]}) is None
    assert prompt_tokens((), {"prompt_token_ids": "abc"}) is None


def test_tokenizer_hook_for_text_and_chat() -> None:
    tokenizer = load_tokenizer("support.tokenizers:bytes_tokenizer")
    assert prompt_tokens(({"prompt": "hi"},), {}, tokenizer) == array("I", [104, 105])
    chat = {"messages": [{"role": "user", "content": "ok"}]}
    assert prompt_tokens((chat,), {}, tokenizer) == array("I", [111, 107])
    assert prompt_tokens(({"prompt": [3]},), {}, tokenizer) == array("I", [3])  # tokens win


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("nocolon", "tokenizer must be 'package.module:function', got 'nocolon'"),
        (
            "support.tokenizers:",
            "tokenizer must be 'package.module:function', got 'support.tokenizers:'",
        ),
        (
            "no_such_module_x:f",
            "cannot load tokenizer 'no_such_module_x:f': No module named 'no_such_module_x'",
        ),
        (
            "support.tokenizers:missing",
            "cannot load tokenizer 'support.tokenizers:missing': module 'support.tokenizers' has no attribute 'missing'",
        ),
        (
            "support.tokenizers:NOT_CALLABLE",
            "tokenizer 'support.tokenizers:NOT_CALLABLE' is not callable",
        ),
    ],
)
def test_bad_tokenizer_path(path: str, message: str) -> None:
    with pytest.raises(ValueError) as error:
        load_tokenizer(path)
    assert str(error.value) == message


def test_lora_name_from_kwarg_or_multiplexed_model() -> None:
    assert prompt_lora_name({"lora_name": "sql"}, "other") == "sql"
    assert prompt_lora_name({}, "sql") == "sql"
    assert prompt_lora_name({}, "") is None
    assert prompt_lora_name({}, None) is None


def test_vllm_engine_kwargs_with_native_offload() -> None:
    kwargs = vllm_engine_kwargs(
        PORTS,
        block_size=32,
        kv_offloading_backend="native",
        kv_offloading_size=8,
        model="m",
        kv_transfer_config={"kv_connector_extra_config": {"offload_prompt_only": False}},
    )
    assert kwargs == {
        "model": "m",
        "enable_prefix_caching": True,
        "kv_events_config": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://127.0.0.1:30000",
            "replay_endpoint": "tcp://127.0.0.1:30002",
            "topic": "",
        },
        "data_parallel_size": 2,
        "block_size": 32,
        "kv_offloading_backend": "native",
        "kv_offloading_size": 8,
        "kv_transfer_config": {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "offload_prompt_only": False,
                "self_describing_kv_events": True,
            },
        },
    }
    assert engine_env(offloading=True) == {
        "PYTHONHASHSEED": "0",
        "VLLM_USE_SIMPLE_KV_OFFLOAD": "0",
    }
    assert engine_env() == {"PYTHONHASHSEED": "0"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"enable_prefix_caching": False},
            "KV-aware routing needs enable_prefix_caching=True (no events without)",
        ),
        (
            {"kv_offloading_backend": "native"},
            "give both kv_offloading_backend and kv_offloading_size, or neither",
        ),
    ],
)
def test_vllm_engine_kwargs_refuse(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as error:
        vllm_engine_kwargs(PORTS, **kwargs)  # type: ignore[arg-type]
    assert str(error.value) == message


def test_port_ranges_are_free_and_consecutive() -> None:
    import socket

    ports = KVEventPorts.allocate(dp_size=3)
    assert (ports.engine_replay, ports.relay, ports.relay_replay) == (
        ports.engine + 3,
        ports.engine + 6,
        ports.engine + 9,
    )
    for port in range(ports.engine, ports.engine + 12):
        with socket.socket() as probe:
            probe.bind(("0.0.0.0", port))
    with pytest.raises(ValueError, match="count must be positive, got 0"):
        free_port_range(0)


def test_a_deployments_routers_share_its_first_routing_state() -> None:
    """Every router of a deployment in a process shares one state, a redeployment's too (the
    old version's routers may still be deciding): options other than the state's are not
    taken, and each other set is logged once, with what was kept."""
    deployment = "helpers#shared"
    try:
        with structlog.testing.capture_logs() as logs:
            first = routing_state(deployment, block_size=16, model_name="m")
            assert routing_state(deployment, block_size=16, model_name="m") is first
            assert routing_state(deployment, block_size=32, model_name="m") is first
            assert routing_state(deployment, block_size=32, model_name="m") is first
            assert routing_state(deployment, model_name="other") is first
        assert find_routing_state(deployment) is first
        assert (first.block_size, first.model_name) == (16, "m")
        warnings = [
            (line["kept"], line["ignored"]) for line in logs if line["log_level"] == "warning"
        ]
        kept = {"block_size": 16, "model_name": "m"}
        assert warnings == [
            (kept, {"block_size": 32, "model_name": "m"}),
            (kept, {"model_name": "other"}),
        ]
    finally:
        close_routing_states()
    assert find_routing_state(deployment) is None


@pytest.mark.parametrize(
    ("ranking", "workers", "expected"),
    [
        # A first answer among several registered replicas is the pick alone: Serve asks
        # again if it is full, and the retry's ranking holds the others.
        ([[1]], {1: "a", 2: "b"}, [["A"]]),
        # The retry's ranking: the unregistered candidate is the last resort.
        ([[1], [2]], {1: "a", 2: "b"}, [["A"], ["B"], ["C"]]),
        # The only registered replica's pick holds every registered one.
        ([[1]], {1: "a"}, [["A"], ["C"]]),
        # A replica registered after the ranking was made goes last, before the unregistered.
        ([[1], [2]], {1: "a", 2: "b", 4: "d"}, [["A"], ["B"], ["D", "C"]]),
        # A ranked replica no longer among the candidates is left out.
        ([[1], [2]], {1: "a"}, [["A"], ["C"]]),
    ],
)
def test_replica_groups_put_what_dynamo_did_not_rank_last(
    ranking: list[list[int]], workers: dict[int, str], expected: list[list[str]]
) -> None:
    by_id = {replica: replica.upper() for replica in ("a", "b", "c", "d")}
    assert replica_groups(ranking, workers, by_id, ["C"]) == expected
