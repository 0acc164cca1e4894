"""The config tree: defaults, layering, the example file, and one-line errors naming the key."""

from __future__ import annotations

import re
import subprocess

import pytest
from conftest import REPO

from app.api.config import Config, key_paths, load_config
from kvstore import config as store_config
from kvstore.config import ConfigError, env_name, parse_set


def test_defaults_load_without_file_or_env():
    cfg = load_config(env={})
    assert isinstance(cfg, Config) and cfg.page_size == 16
    assert cfg.hot.pool == 256 << 20
    assert cfg.warm.bytes == 1 << 30
    assert cfg.cold.max_bytes == 8 << 30
    assert cfg.cold_map_size_max == 16 << 30
    assert cfg.eviction_policy == "lru"


def test_file_below_env_below_overrides(tmp_path):
    file = tmp_path / "kv.yaml"
    file.write_text("page_size: 32\nmax_seq_len: 1000\nwarm:\n  bytes: 2GiB\nhot:\n  pool: 1GiB\n")
    env = {"KVSTORE_MAX_SEQ_LEN": "2000", "KVSTORE_HOT_POOL": "3GiB", "PATH": "/bin"}
    cfg = load_config(file, env, {"hot.pool": "4GiB"})
    assert cfg.page_size == 32                # file only
    assert cfg.warm.bytes == 2 << 30          # file only
    assert cfg.max_seq_len == 2000            # env beats file
    assert cfg.hot.pool == 4 << 30            # overrides beat env and file
    assert cfg.cold.max_bytes == 8 << 30      # untouched default


def test_config_file_from_env_variable(tmp_path):
    file = tmp_path / "kv.yaml"
    file.write_text("page_size: 64\n")
    assert load_config(env={"KVSTORE_CONFIG": str(file)}).page_size == 64


def test_example_file_loads_and_matches_the_defaults():
    example = load_config(REPO / "etc" / "kvstore.yaml", env={})
    assert example == load_config(env={})


def test_example_file_names_every_key():
    text = (REPO / "etc" / "kvstore.yaml").read_text()
    for path in key_paths():
        assert f"{path.rsplit('.', 1)[-1]}:" in text, path


def test_the_store_alone_loads_its_own_tree():
    """The store's tree (kvstore.config) has no engine sections; the engine's extends it, so one
    file and one precedence serve both."""
    store = store_config.load_config(env={})
    assert not hasattr(store, "engine") and isinstance(load_config(env={}), store_config.Config)
    assert set(store_config.key_paths()) < set(key_paths())
    with pytest.raises(ConfigError, match="engine.dtype"):
        store_config.load_config(env={}, overrides={"engine.dtype": "float32"})
    with pytest.raises(ConfigError, match="KVSTORE_SERVER_PORT"):
        store_config.load_config(env={"KVSTORE_SERVER_PORT": "1"})


def test_env_names_are_derived_from_paths():
    assert env_name("hot.pool") == "KVSTORE_HOT_POOL"
    assert env_name("page_size") == "KVSTORE_PAGE_SIZE"


def test_the_test_scripts_variables_are_accepted():
    """Every KVSTORE_ variable scripts/test reads may be set while kvstore runs (the suite runs the
    store in its process): KVSTORE_TEST_SGLANG=0 was refused as an unknown variable."""
    names = set(re.findall(r"\$\{(KVSTORE_[A-Z_]+)", (REPO / "scripts" / "test").read_text()))
    assert {"KVSTORE_TEST_VLLM", "KVSTORE_TEST_SGLANG"} <= names
    for name in names:
        store_config.load_config(env={name: "0"})


def test_parse_set():
    assert parse_set(["hot.pool=2GiB", "page_size=32"]) == {"hot.pool": "2GiB", "page_size": "32"}
    with pytest.raises(ConfigError, match="--set"):
        parse_set(["page_size"])


@pytest.mark.parametrize("file_text, overrides, env, key", [
    ("nope: 1\n", None, None, "nope"),
    ("hot:\n  nope: 1\n", None, None, "hot.nope"),
    (None, {"hot.pool": "12 parsecs"}, None, "hot.pool"),
    (None, {"warm.bytes": "lots"}, None, "warm.bytes"),
    (None, {"hot.high_watermark": "1.5"}, None, "hot.high_watermark"),
    (None, {"hot.low_watermark": "0.9", "hot.high_watermark": "0.9"}, None, "hot.low_watermark"),
    (None, {"cold.low_watermark": "0.99"}, None, "cold.low_watermark"),
    (None, {"eviction_policy": "bogus"}, None, "eviction_policy"),
    (None, {"page_size": "0"}, None, "page_size"),
    (None, {"page_size": "12"}, None, "page_size"),
    (None, {"page_size": "-16"}, None, "page_size"),
    (None, {"page_size": "abc"}, None, "page_size"),
    ("page_size: 12\n", None, None, "page_size"),
    (None, {"nope": "1"}, None, "nope"),
    (None, None, {"KVSTORE_PAGE_SIZE": "3"}, "page_size"),
    (None, None, {"KVSTORE_NOPE": "1"}, "KVSTORE_NOPE"),
    ("page_size: [16\n", None, None, "config"),
    ("- a list\n", None, None, "config"),
])
def test_invalid_config_names_the_key(tmp_path, file_text, overrides, env, key):
    file = None
    if file_text is not None:
        file = tmp_path / "kv.yaml"
        file.write_text(file_text)
    with pytest.raises(ConfigError) as info:
        load_config(file, env or {}, overrides)
    assert info.value.key == key
    assert str(info.value).startswith(key)
    assert "\n" not in str(info.value)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml", env={})


def test_cli_prints_the_effective_config(kvstore_cli, tmp_path):
    import yaml

    file = tmp_path / "kv.yaml"
    file.write_text("page_size: 32\n")
    out = kvstore_cli("config", "--config", file, "--set", "hot.pool=2GiB", "--data-dir", tmp_path / "d",
                      env={"KVSTORE_MAX_SEQ_LEN": "1024"})
    assert out.returncode == 0, out.stderr
    shown = yaml.safe_load(out.stdout)
    assert shown["page_size"] == 32 and shown["max_seq_len"] == 1024
    assert shown["hot"]["pool"] == 2 << 30 and shown["data_dir"] == str(tmp_path / "d")


def test_cli_lists_every_key(kvstore_cli):
    out = kvstore_cli("config", "--keys")
    assert out.returncode == 0, out.stderr
    for path in key_paths():
        assert path in out.stdout and env_name(path) in out.stdout


def _assert_one_line_error(out: subprocess.CompletedProcess, key: str) -> None:
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("kvstore: error: ") and key in lines[0], lines[0]
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("args, env, key", [
    (["--set", "page_size=12"], None, "page_size"),
    (["--set", "nope=1"], None, "nope"),
    (["--set", "eviction_policy=bogus"], None, "eviction_policy"),
    (["--set", "hot.high_watermark=2"], None, "hot.high_watermark"),
    (["--set", "page_size"], None, "--set"),
    ([], {"KVSTORE_PAGE_SIZE": "3"}, "page_size"),
    ([], {"KVSTORE_BOGUS": "1"}, "KVSTORE_BOGUS"),
])
def test_cli_config_errors_are_one_line(kvstore_cli, args, env, key):
    _assert_one_line_error(kvstore_cli("config", *args, env=env), key)


def test_cli_bad_config_file_is_one_line(kvstore_cli, tmp_path):
    file = tmp_path / "kv.yaml"
    file.write_text("cold:\n  max_bytes: huge\n")
    _assert_one_line_error(kvstore_cli("config", "--config", file), "cold.max_bytes")
    file.write_text("hot: [unclosed\n")
    _assert_one_line_error(kvstore_cli("config", "--config", file), "config")
    _assert_one_line_error(kvstore_cli("config", "--config", tmp_path / "absent.yaml"), "config")


def test_readme_config_reference_is_current():
    """README.md carries the table scripts/config_reference prints; rerun it after changing config.py."""
    readme = (REPO / "README.md").read_text()
    for key, env, default, allowed in store_config.reference_rows(Config):
        assert f"| `{key}` | `{env}` | `{default}` | {allowed} |" in readme, key
