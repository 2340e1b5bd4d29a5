"""guijax.schema: every kind of config problem fails naming its full dotted key, every recipe validates, and
the schema's choices agree with the code that acts on them."""
from __future__ import annotations

import dataclasses
import typing

import ml_collections
import pytest

from guijax import launch, schema
from guijax.config import ConfigError, available_configs, load_config


from guijax.methods import option_sections

EXTRAS = option_sections()  # the sections the registered methods declare


def node(cls: type = schema.Rollout, **changes) -> ml_collections.ConfigDict:
    """A section's defaults with some values replaced (whatever their type) or, given None, removed."""
    values = section_dict(cls)
    for key, value in changes.items():
        if value is None:
            del values[key]
        else:
            values[key] = value
    return ml_collections.ConfigDict(values)


def section_dict(cls: type) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def errors_of(cls: type, prefix: str, **changes) -> str:
    with pytest.raises(ConfigError) as e:
        schema.parse_section(cls, node(cls, **changes), prefix)
    return str(e.value)


@pytest.mark.parametrize("name", available_configs())
def test_every_recipe_validates(name):
    config = load_config(name)
    run = schema.validate(config, EXTRAS)
    assert run.name == name and run.stages == tuple(config.stages)
    assert run.train.eps_low == config.train.eps_low and run.rollout.prompt == config.rollout.prompt
    assert run.env.screen == tuple(config.env.screen) and run.model.remat == config.model.remat
    assert run.sections["bepa"].plan_extractor == config.bepa.plan_extractor
    assert set(run.sections) == set(EXTRAS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.train = None  # type: ignore[misc]


def test_sections_nobody_declares_fail_by_name():
    config = load_config("grpo_cpu")
    with pytest.raises(ConfigError) as e:
        schema.validate(config, {k: v for k, v in EXTRAS.items() if k != "arpo"})
    assert "undeclared config section 'arpo'" in str(e.value)
    config.rollot = ml_collections.ConfigDict({"group_size": 2})
    with pytest.raises(ConfigError, match=r"undeclared config section 'rollot'; did you mean 'rollout'\?"):
        schema.validate(config, EXTRAS)


def test_missing_sections_and_top_level_keys_fail_by_name():
    config = load_config("grpo_cpu").to_dict()
    del config["bepa"], config["seed"]
    with pytest.raises(ConfigError) as e:
        schema.validate(ml_collections.ConfigDict(config), EXTRAS)
    assert "missing config section 'bepa'" in str(e.value) and "missing config key 'seed'" in str(e.value)


def test_top_level_scalars_are_checked():
    config = load_config("grpo_cpu")
    config.distributed = "yes"
    config.acelerator = "gpu"
    with pytest.raises(ConfigError) as e:
        schema.validate(config, EXTRAS)
    lines = str(e.value).splitlines()
    assert "distributed='yes' is not one of ('auto', 'on', 'off')" in lines
    assert "unknown config key 'acelerator'; did you mean 'accelerator'?" in lines


def test_unknown_key_suggests_the_nearest():
    msg = errors_of(schema.Train, "train", eps_lo=0.2)
    assert msg == "unknown config key 'train.eps_lo'; did you mean 'train.eps_low'?"
    msg = errors_of(schema.DryRun, "dry_run", zzz=1)
    assert msg == "unknown config key 'dry_run.zzz'; known: topology, screenshot_hw, compiler, compiler_memory_gib"


def test_missing_key_fails():
    assert errors_of(schema.Train, "train", kl_coef=None) == "missing config key 'train.kl_coef'"


def test_wrong_types_fail():
    assert errors_of(schema.Rollout, "rollout", top_k="5") == "rollout.top_k='5' must be an int, got str"
    assert errors_of(schema.Rollout, "rollout", top_k=True) == "rollout.top_k=True must be an int, got bool"
    assert errors_of(schema.Rollout, "rollout", top_p="1") == "rollout.top_p='1' must be a float, got str"
    assert errors_of(schema.Model, "model", scan_layers=1) == "model.scan_layers=1 must be a bool, got int"
    assert errors_of(schema.Env, "env", server_urls="http://a") == "env.server_urls='http://a' must be a tuple, got str"
    assert errors_of(schema.Env, "env", screen=(280,)) == "env.screen=(280,) must have 2 items, got 1"
    assert errors_of(schema.Env, "env", server_urls=("a", 2)) == "env.server_urls[1]=2 must be a str, got int"


def test_int_widens_to_float_and_list_to_tuple():
    run = schema.parse_section(schema.Rollout, node(temperature=2), "rollout")
    assert run.temperature == 2.0 and isinstance(run.temperature, float)
    ev = schema.parse_section(schema.Eval, node(schema.Eval, pass_k=[1, 4], splits=["held_out"]), "eval")
    assert ev.pass_k == (1, 4) and ev.splits == ("held_out",)


def test_choices_are_enforced():
    msg = errors_of(schema.Rollout, "rollout", prompt="foo")
    assert msg == ("rollout.prompt='foo' is not one of ('uitars_official', 'uitars_v1', 'compact', 'computer_use', "
                   "'computer_use_compact', 'pyautogui', 'pyautogui_think')")
    msg = errors_of(schema.Eval, "eval", splits=("train", "test"))
    assert msg == "eval.splits[1]='test' is not one of ('train', 'held_out', 'expert_only')"
    assert "env.families[0]='click_buton' is not one of" in errors_of(schema.Env, "env", families=("click_buton",))


def test_ranges_are_enforced():
    assert errors_of(schema.Train, "train", eps_low=1.5) == "train.eps_low=1.5 must be in [0, 1)"
    assert errors_of(schema.Train, "train", eps_low=1.0) == "train.eps_low=1.0 must be in [0, 1)"
    assert errors_of(schema.Rollout, "rollout", top_p=0.0) == "rollout.top_p=0.0 must be in (0, 1]"
    msg = errors_of(schema.Rollout, "rollout", temperature=float("nan"))
    assert msg == "rollout.temperature=nan must be in (0, inf)"
    assert errors_of(schema.Rollout, "rollout", group_size=0) == "rollout.group_size=0 must be in [1, inf)"
    assert errors_of(schema.Eval, "eval", pass_k=(1, 0)) == "eval.pass_k[1]=0 must be in [1, inf)"
    assert schema.parse_section(schema.Rollout, node(top_p=1.0, temperature=1e-3), "rollout").top_p == 1.0


def test_sentinels_outside_a_range():
    assert errors_of(schema.Train, "train", dual_clip=0.5) == "train.dual_clip=0.5 must be 0 or in (1, inf)"
    assert schema.parse_section(schema.Train, node(schema.Train, dual_clip=0.0), "train").dual_clip == 0.0
    assert schema.parse_section(schema.Train, node(schema.Train, dual_clip=2.0), "train").dual_clip == 2.0
    assert errors_of(schema.Mesh, "mesh", fsdp=0) == "mesh.fsdp=0 must be -1 or in [1, inf)"
    assert schema.parse_section(schema.Mesh, node(schema.Mesh, data=-1, fsdp=4), "mesh").data == -1


def test_every_problem_of_a_section_is_reported_at_once():
    lines = errors_of(schema.Rollout, "rollout", prompt="foo", group_size=0, top_k=None).splitlines()
    assert sorted(lines) == ["missing config key 'rollout.top_k'", "rollout.group_size=0 must be in [1, inf)",
                             "rollout.prompt='foo' is not one of ('uitars_official', 'uitars_v1', 'compact', "
                             "'computer_use', 'computer_use_compact', 'pyautogui', 'pyautogui_think')"]


def test_override_out_of_range_fails_naming_the_key():
    config = launch.resolve("grpo_cpu", ["rollout.temperature=-1"])
    with pytest.raises(ConfigError, match=r"^rollout\.temperature=-1\.0 must be in \(0, inf\)$"):
        schema.validate(config, EXTRAS)


@pytest.mark.parametrize("cls", [schema.TopLevel, *schema.GENERIC.values()])
def test_defaults_satisfy_their_own_schema(cls):
    assert schema.parse_section(cls, schema.section_defaults(cls), cls.__name__.lower()) == cls()


def test_extra_sections_may_not_shadow_generic_ones():
    with pytest.raises(ValueError, match="clash"):
        schema.validate(load_config("grpo_cpu"), {**EXTRAS, "train": schema.Compare})


def choices(cls: type, field: str) -> tuple:
    tp = typing.get_type_hints(cls)[field]
    if typing.get_origin(tp) is tuple:
        tp = typing.get_args(tp)[0]
    return typing.get_args(tp)


def test_choices_agree_with_the_code_that_uses_them():
    from envs.desk.families import FAMILIES
    from guijax import losses, optim
    from guijax.kernels import api
    from guijax.models import attention, policy, scan
    from guijax.models.config import PRESETS

    assert set(choices(schema.Model, "remat")) == set(scan.REMAT_POLICIES)
    assert set(choices(schema.Model, "attention")) == set(attention.IMPLEMENTATIONS)
    assert set(choices(schema.Model, "preset")) == set(PRESETS)
    assert set(choices(schema.Model, "dtype")) == set(policy.DTYPES)
    assert set(choices(schema.Model, "param_dtype")) == {"", *policy.DTYPES}
    assert set(choices(schema.Train, "logprob_impl")) == set(api.IMPLS)
    assert set(choices(schema.Train, "normalization")) == set(losses.NORMALIZATIONS)
    assert set(choices(schema.Optim, "state_dtype")) == set(optim.DTYPES)
    for name in choices(schema.Optim, "schedule"):
        optim.make_schedule(1e-3, 1, 10, name)
    for cls, field in ((schema.Env, "families"), (schema.Sft, "families"), (schema.Sft, "plan_only_families")):
        assert set(choices(cls, field)) == set(FAMILIES)
