"""The cluster config: defaults, YAML, overrides, and errors that name the field."""

from __future__ import annotations

import pytest

from cluster.config import load_config
from protos.errors import ConfigError


def test_defaults_serve_smollm2_with_one_instance_per_pool():
    cfg = load_config()
    assert cfg.engine.model == "smollm2"
    assert (cfg.prefill.num_instances, cfg.decode.num_instances) == (1, 1)
    assert (cfg.gateway.host, cfg.gateway.port) == ("127.0.0.1", 50051)
    assert cfg.redis.url is None and cfg.ray.address is None


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("prefill:\n  num_instances: 3\ngateway:\n  port: 6000\n")
    cfg = load_config(path, {"gateway.port": 7000, "decode.num_instances": 2})
    assert (cfg.prefill.num_instances, cfg.decode.num_instances, cfg.gateway.port) == (3, 2, 7000)


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("prefill:\n  num_instances: -1\n", "prefill.num_instances"),
        ("conductor:\n  policy: fastest\n", "unknown policy 'fastest'"),
        ("engine:\n  modle: tiny\n", "engine.modle"),
        ("gateway:\n  port: 70000\n", "gateway.port"),
        ("- just\n- a list\n", "mapping"),
        ("prefill: [unclosed\n", "not valid YAML"),
        ("name: Bad_Name\n", "name"),
        ("conductor:\n  tuning:\n    ttft_slo_ms: -5\n", "conductor.tuning.ttft_slo_ms"),
        ("conductor:\n  coalesce_min_blocks: 0\n", "conductor.coalesce_min_blocks"),
        ("gateway:\n  enabled: false\nhttp:\n  enabled: false\n", "enable a front"),
        ("prefill:\n  num_instances: 0\nconductor:\n  policy: round_robin\n",
         "prefill.num_instances is 0 but conductor.policy 'round_robin' needs a prefill instance"),
    ],
)
def test_invalid_config_names_the_problem(tmp_path, text, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=None) as info:
        load_config(path)
    assert fragment in str(info.value)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_override_into_a_scalar_is_rejected():
    with pytest.raises(ConfigError, match="not a section"):
        load_config(None, {"name": "abc", "name.inner": 1})


def test_the_documented_local_config_is_exactly_the_defaults():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "deploy" / "local.yaml"
    assert load_config(path) == load_config()


def test_api_key_file_is_read_one_key_per_line(tmp_path):
    from gateway.auth import read_api_keys as _read_api_keys

    keys = tmp_path / "keys"
    keys.write_text("# operators\nsk-one\n\n  sk-two  \n")
    assert _read_api_keys(str(keys)) == frozenset({"sk-one", "sk-two"})
    assert _read_api_keys(None) == frozenset()
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="holds no key"):
        _read_api_keys(str(empty))
    with pytest.raises(ConfigError, match="cannot read"):
        _read_api_keys(str(tmp_path / "missing"))


def test_an_empty_prefill_pool_is_valid_with_the_baton_policy():
    assert load_config(None, {"prefill.num_instances": 0}).prefill.num_instances == 0
