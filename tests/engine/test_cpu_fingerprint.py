"""The CPU description a calibration is keyed on and the benchmarks print: model name with
family and model numbers, and the caches."""

from __future__ import annotations

from refattn.engine.numba import providers

ZEN4 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
        "model name\t: AMD EPYC\n\nprocessor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\n"
        "model name\t: Other\n")


def test_the_model_name_carries_family_and_model_of_the_first_cpu():
    assert providers.cpu_model(ZEN4) == "AMD EPYC (family 25, model 17)"
    assert providers.cpu_model("model name\t: Intel(R) Xeon(R) CPU\n") == "Intel(R) Xeon(R) CPU"


def test_caches_list_data_and_unified_levels(tmp_path):
    caches = [("1", "Data", "32K"), ("1", "Instruction", "32K"), ("2", "Unified", "1024K"),
              ("3", "Unified", "32768K")]
    for n, (level, kind, size) in enumerate(caches):
        d = tmp_path / f"index{n}"
        d.mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (d / name).write_text(value + "\n")
    assert providers.cpu_caches(tmp_path) == "L1d 32K, L2 1024K, L3 32768K"
    assert providers.cpu_caches(tmp_path / "absent") == ""


def test_two_cpus_of_one_name_have_different_fingerprints(monkeypatch):
    """A Zen 4 and a Zen 5 VM both call themselves 'AMD EPYC': their calibrations must not be
    shared."""
    model = providers.cpu_model
    zen5 = ZEN4.replace("cpu family\t: 25\nmodel\t\t: 17", "cpu family\t: 26\nmodel\t\t: 2", 1)
    prints = []
    for text in (ZEN4, zen5):
        monkeypatch.setattr(providers, "cpu_model", lambda text=text: model(text))
        prints.append(providers.fingerprint())
    assert prints[0]["cpu"] == "AMD EPYC (family 25, model 17)"
    assert prints[1]["cpu"] == "AMD EPYC (family 26, model 2)"
    assert prints[0] != prints[1]
