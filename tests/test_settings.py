"""Settings are read once, validated, and every error names the key, the value and the fix."""

from __future__ import annotations

import pytest
from conftest import make_config

from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.core.options import PluginOptions
from fd_cudagraph_plugin.core.settings import Settings
from fd_cudagraph_plugin.core.sizes import padding_table


def _set(path: str, value):
    def apply(config):
        target = config
        *parents, leaf = path.split(".")
        for name in parents:
            target = getattr(target, name)
        setattr(target, leaf, value)

    return apply


BAD_CONFIG = [
    ("graph_opt_config.cudagraph_capture_sizes", [0], "no size above 0"),
    ("graph_opt_config.cudagraph_capture_sizes", [-4], "positive integers"),
    ("graph_opt_config.cudagraph_capture_sizes", [1.5, 4], "positive integers"),
    ("graph_opt_config.cudagraph_capture_sizes", ["8"], "positive integers"),
    ("graph_opt_config.cudagraph_capture_sizes", [True, 4], "positive integers"),
    ("graph_opt_config.cudagraph_capture_sizes", [], "non-empty list"),
    ("graph_opt_config.cudagraph_capture_sizes", None, "non-empty list"),
    ("graph_opt_config.cudagraph_capture_sizes", "1,2,4", "non-empty list"),
    ("graph_opt_config.cudagraph_num_of_warmups", 1.5, "must be an integer"),
    ("graph_opt_config.cudagraph_num_of_warmups", "2", "must be an integer"),
    ("graph_opt_config.max_capture_shape_prefill", -1, "integer >= 0"),
    ("graph_opt_config.graph_opt_level", 3, "must be 0, 1 or 2"),
    ("graph_opt_config.graph_opt_level", "1", "must be 0, 1 or 2"),
    ("graph_opt_config.real_bsz_to_captured_size", {"a": 2}, "non-integer entry"),
    ("graph_opt_config.real_bsz_to_captured_size", [1, 2], "must be a dict"),
    ("scheduler_config.max_num_seqs", 0, "integer >= 1"),
    ("parallel_config.tensor_parallel_size", 0, "integer >= 1"),
]


@pytest.mark.parametrize(
    ("key", "value", "message"), BAD_CONFIG, ids=[f"{k}={v!r}" for k, v, _ in BAD_CONFIG]
)
def test_bad_config_value_names_key_value_and_fix(key, value, message):
    config = make_config(8)
    _set(key, value)(config)
    with pytest.raises(ConfigError) as raised:
        Settings.from_fd_config(config)
    text = str(raised.value)
    assert key in text
    assert message in text
    assert repr(value) in text or str(value) in text


BAD_ENV = [
    ("FD_CUDAGRAPH_RUNTIME", "gpu"),
    ("FD_CUDAGRAPH_RUNTIME", "cuda-graphs"),
    ("FD_CUDAGRAPH_BACKEND", "upstream"),
]


@pytest.mark.parametrize(("env", "value"), BAD_ENV)
def test_unknown_option_value_lists_the_allowed_values(monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    with pytest.raises(ConfigError, match=rf"{env}='{value}' is not a known value; allowed"):
        Settings.from_fd_config(make_config(8))


def test_missing_graph_opt_config_is_a_config_error():
    with pytest.raises(ConfigError, match="graph_opt_config is missing"):
        Settings.from_fd_config(object())


def test_none_speculative_config_means_no_speculative_decoding():
    config = make_config(8)
    config.speculative_config = None
    settings = Settings.from_fd_config(config)
    assert settings.speculative_method is None and not settings.mode.keyed_by_running


def test_settings_are_frozen_and_sizes_descending():
    settings = Settings.from_fd_config(make_config(8, cudagraph_capture_sizes=[2, 8, 4, 8]))
    assert settings.capture_sizes == (8, 4, 2)
    with pytest.raises(AttributeError):
        settings.num_warmups = 5


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ([8, 4, 2, 1], [0, 1, 2, 4, 4, 8, 8, 8, 8]),
        ([3], [0, 3, 3, 3]),
        ([6, 2], [0, 2, 2, 6, 6, 6, 6]),
    ],
)
def test_padding_table_gives_smallest_captured_size_at_or_above(sizes, expected):
    assert padding_table(sizes) == expected


def test_padding_table_matches_fastdeploys_map_when_it_is_not_stale():
    config = make_config(256)
    table = padding_table(config.graph_opt_config.cudagraph_capture_sizes)
    upstream = config.graph_opt_config.real_shape_to_captured_size
    assert {n: table[n] for n in range(len(table))} == upstream


@pytest.mark.parametrize(
    ("env", "value"),
    [
        ("FD_CUDAGRAPH_AR_REGISTRATION", "per_graph"),
        ("FD_CUDAGRAPH_AR_REGISTRATION", "session"),
        ("FD_CUDAGRAPH_AR_REGISTRATION", "anything"),
        ("FD_CUDAGRAPH_LATE_CAPTURE", "capture"),
        ("FD_CUDAGRAPH_LATE_CAPTURE", "eager"),
        ("FD_CUDAGRAPH_WARMUP", "warm_all_first"),
        ("FD_CUDAGRAPH_WARMUP", "largest_only"),
        ("FD_CUDAGRAPH_WARMUP", "per_size"),
        ("FD_CUDAGRAPH_POOL", "device"),
        ("FD_CUDAGRAPH_POOL", "Device"),
    ],
)
def test_a_removed_option_stops_register_saying_it_was_removed_and_why(
    monkeypatch, plugin_registered, env, value
):
    from fd_cudagraph_plugin import plugin

    monkeypatch.setenv(env, value)
    version = "0\\.3" if env in ("FD_CUDAGRAPH_WARMUP", "FD_CUDAGRAPH_POOL") else "0\\.2"
    with pytest.raises(
        ConfigError,
        match=rf"^{env}(=device)? was removed in fd-cudagraph-plugin {version}: .*Unset",
    ):
        plugin.register()


@pytest.mark.parametrize(
    ("env", "value", "message"),
    [
        ("FD_CUDAGRAPH_STATS_INTERVAL", "1e10", "0 \\(off\\) or .* from 1 to 86400"),
        ("FD_CUDAGRAPH_STATS_INTERVAL", "nan", "0 \\(off\\) or .* from 1 to 86400"),
        # Below a second the reporter takes time from serving (1e-9: served steps fell 40%).
        ("FD_CUDAGRAPH_STATS_INTERVAL", "1e-9", "0 \\(off\\) or .* from 1 to 86400"),
        ("FD_CUDAGRAPH_STATS_INTERVAL", "0.5", "0 \\(off\\) or .* from 1 to 86400"),
        ("FD_CUDAGRAPH_CHECK_ADDRESSES", "sampled:99999999999999999999", "1 <= N <= 1000000"),
        ("FD_CUDAGRAPH_CHECK_ADDRESSES", "sampled:0", "1 <= N <= 1000000"),
        ("FD_CUDAGRAPH_RANK_TIMEOUT", "0", "from 1 to 86400"),
        ("FD_CUDAGRAPH_RANK_TIMEOUT", "1e9", "from 1 to 86400"),
        ("FD_CUDAGRAPH_RANK_TIMEOUT", "soon", "from 1 to 86400"),
        # float() reads these, none of which an operator means: Arabic-Indic ten, underscores,
        # exponents, infinity.
        ("FD_CUDAGRAPH_RANK_TIMEOUT", "\u0661\u0660", "from 1 to 86400"),
        ("FD_CUDAGRAPH_RANK_TIMEOUT", "1_000", "from 1 to 86400"),
        ("FD_CUDAGRAPH_RANK_TIMEOUT", "3e1", "from 1 to 86400"),
        ("FD_CUDAGRAPH_RANK_TIMEOUT", "inf", "from 1 to 86400"),
        ("FD_CUDAGRAPH_STATS_INTERVAL", "1_0", "0 \\(off\\) or .* from 1 to 86400"),
        ("FD_CUDAGRAPH_CHECK_ADDRESSES", "sampled:\u0661\u0660", "1 <= N <= 1000000"),
    ],
)
def test_numeric_options_are_range_checked(monkeypatch, env, value, message):
    monkeypatch.setenv(env, value)
    with pytest.raises(
        ConfigError, match=rf"^{env}='{value}': must .*{message}.*Fix or unset {env}"
    ):
        PluginOptions.from_env()


@pytest.mark.parametrize("value", ["Always", "SAMPLED:4", "Off"])
def test_option_values_are_case_insensitive(monkeypatch, value):
    monkeypatch.setenv("FD_CUDAGRAPH_CHECK_ADDRESSES", value)
    expected = {"always": 1, "sampled:4": 4, "off": 0}[value.lower()]
    assert PluginOptions.from_env().check_addresses == expected


# What FastDeploy itself accepts and serves must not stop the plugin (develop and 2.6 config.py:
# no type checks on the flags, warm-ups run as range(n), a 0 size from 2.4's expert parallelism
# or from max_capture_shape_prefill: 0).
ACCEPTED = [
    ("graph_opt_config.max_capture_shape_prefill", 0, "max_capture_shape_prefill", 0),
    ("graph_opt_config.cudagraph_capture_sizes_prefill", [0], "prefill_sizes", ()),
    ("graph_opt_config.cudagraph_capture_sizes_prefill", [], "prefill_sizes", ()),
    ("graph_opt_config.cudagraph_capture_sizes", [0, 8, 4], "capture_sizes", (8, 4)),
    ("graph_opt_config.cudagraph_num_of_warmups", -1, "num_warmups", 0),
    ("graph_opt_config.full_cuda_graph", 1, "full_cuda_graph", True),
    ("graph_opt_config.use_unique_memory_pool", 0, "use_unique_memory_pool", False),
    ("graph_opt_config.cudagraph_only_prefill", None, "only_prefill", False),
]


@pytest.mark.parametrize(
    ("key", "value", "field", "expected"), ACCEPTED, ids=[f"{k}={v!r}" for k, v, _, _ in ACCEPTED]
)
def test_what_fastdeploy_accepts_is_accepted(key, value, field, expected):
    config = make_config(8)
    _set(key, value)(config)
    assert getattr(Settings.from_fd_config(config), field) == expected


def test_static_split_without_prefill_graphs_serves_prefill_eagerly_without_a_warning(sim, caplog):
    import logging

    from conftest import Buffers, TinyBackbone

    from fd_cudagraph_plugin.core.backend import CudaGraphBackend

    config = make_config(8, graph_opt_level=1, full_cuda_graph=False)
    _set("graph_opt_config.max_capture_shape_prefill", 0)(config)
    _set("graph_opt_config.cudagraph_capture_sizes_prefill", [0])(config)
    model = TinyBackbone()
    backend = CudaGraphBackend(fd_config=config, dy_runnable=model.forward, runnable=model.forward)
    step = Buffers().step(5)
    step["forward_meta"].exist_prefill = True
    with caplog.at_level(logging.WARNING, logger="fd_cudagraph_plugin"):
        out = backend(**step)
    assert out.shape[0] == 5 and backend.stats()["eager_fallbacks"] == {"prefill": 1}
    assert backend.expected() == list(backend.table.decode.values())
    assert not caplog.records


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("FD_CUDAGRAPH_TIMEOUT", "did you mean FD_CUDAGRAPH_RANK_TIMEOUT?"),
        ("FD_CUDAGRAPH_SELFCHECK", "did you mean FD_CUDAGRAPH_SELF_CHECK?"),
        # The prefix alone made every name look close: both were "did you mean ..._POOL?".
        ("FD_CUDAGRAPH_FOO", "no option is close to it"),
        ("FD_CUDAGRAPH_", "no option is close to it"),
    ],
)
def test_a_misspelt_option_is_told_the_closest_name_or_that_none_is_close(name, hint):
    from fd_cudagraph_plugin.core.options import unknown_options

    assert unknown_options({name: "1"}) == [f"{name} ({hint})"]
