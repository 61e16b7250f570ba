"""The key log (runtime/cache.py, $FORGEKERNEL_KEYLOG): every kernel `_load` loads is recorded,
prebuilt or compiled, and `forgekernel build --keys` builds only those of the configurations
its other options choose (scripts/device_setup.sh sets the log; scripts/take_results.sh keeps
the union in benchmarks/keys/)."""

from __future__ import annotations

import json
from pathlib import Path

import forgekernel.runtime.build as build
import forgekernel.runtime.cache as cache
from forgekernel import cli
from forgekernel.runtime.spec import all_specs


def _unsorted_key():
    """A standard or candidate configuration whose params are not in sorted order (the log
    must give back the tuple as it was: the compile key hashes it in order)."""
    for spec in all_specs():
        for p in (*spec.standard_params(), *spec.candidate_params()):
            if tuple(sorted(p)) != tuple(p):
                return spec, p
    spec = all_specs()[0]
    return spec, tuple(reversed(spec.representative_params()))


def test_loads_are_logged_prebuilt_and_read_back_in_order(tmp_path, monkeypatch):
    log = tmp_path / "keys.jsonl"
    monkeypatch.setenv(cache.KEYLOG_ENV, str(log))
    monkeypatch.setattr(cache, "_LOADED", {})
    monkeypatch.setattr(cache, "resolve_arch", lambda arch: "sm_90a")
    monkeypatch.setattr(cache, "search_dirs", lambda arch: [tmp_path])
    monkeypatch.setattr(cache, "load_function", lambda so, symbol: ("loaded", so.name))
    spec = next(s for s in all_specs() if s.arch == "sm_90a")
    first = spec.representative_params()
    other_spec, other = _unsorted_key()
    for s, p in ((spec, first), (other_spec, other)):
        (tmp_path / f"{cache.artifact_stem(s, p)}.so").write_bytes(b"\x7fELF")
    cache._load(spec, first)
    cache._load(other_spec, other)
    cache._load(spec, first)  # loaded once a process: no second line
    assert len(log.read_text().splitlines()) == 2
    log.write_text(log.read_text() * 2)  # another process's lines: read once
    assert cache.read_keylog(log) == [(spec.name, first), (other_spec.name, other)]


def test_nothing_is_logged_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(cache.KEYLOG_ENV, raising=False)
    monkeypatch.setattr(cache, "_LOADED", {})
    monkeypatch.setattr(cache, "resolve_arch", lambda arch: "sm_90a")
    monkeypatch.setattr(cache, "search_dirs", lambda arch: [tmp_path])
    monkeypatch.setattr(cache, "load_function", lambda so, symbol: "loaded")
    spec = all_specs()[0]
    params = spec.representative_params()
    (tmp_path / f"{cache.artifact_stem(spec, params)}.so").write_bytes(b"\x7fELF")
    monkeypatch.chdir(tmp_path)
    assert cache._load(spec, params) == "loaded"
    assert [p.name for p in tmp_path.iterdir()] == [f"{cache.artifact_stem(spec, params)}.so"]


def test_build_takes_only_the_logged_keys_of_its_choice(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(build, "_run", lambda tasks, target, jobs: seen.extend(tasks) or
                        [{"name": n} for n, _ in tasks])  # fmt: skip
    specs = [s for s in all_specs() if s.arch == "sm_90a"]
    a, b = specs[0], specs[1]
    a_std = list(a.standard_params())
    cand = next((s, c) for s in specs for c in s.candidate_params()
                if c not in set(s.standard_params()))  # fmt: skip
    keys = [
        (b.name, tuple(b.standard_params())[0]),
        (a.name, a_std[-1]),
        (a.name, a_std[0]),
        ("no_such_kernel", ()),
        (a.name, (("not", "a config"),)),
        (cand[0].name, cand[1]),
    ]
    build.build_all("sm_90a", tmp_path, keys=keys, jobs=1)
    std_order = [t for t in build.build_tasks("sm_90a") if t in set(keys)]
    assert seen == std_order and len(seen) == 3  # the specs' order; unknown ones dropped
    seen.clear()
    build.build_all("sm_90a", tmp_path, candidates=True, only=[cand[0].name], keys=keys, jobs=1)
    assert (cand[0].name, cand[1]) in seen and all(n == cand[0].name for n, _ in seen)


def test_cli_reads_the_log(tmp_path, monkeypatch):
    log = tmp_path / "keys.jsonl"
    spec = all_specs()[0]
    params = spec.representative_params()
    log.write_text(json.dumps({"name": spec.name, "params": [list(kv) for kv in params]}) + "\n")
    seen = {}

    def fake_build_all(arch, out_dir=None, candidates=False, only=None, **kw):
        seen.update(kw)
        return []

    monkeypatch.setattr(build, "build_all", fake_build_all)
    assert cli.main(["build", "--arch", "sm_90a", "--out", str(tmp_path), "--keys", str(log)]) == 0
    assert seen["keys"] == [(spec.name, params)]
    assert cli.build_parser().parse_args(["build", "--keys", "k.jsonl"]).keys == Path("k.jsonl")
