"""The README's Kimi-K2.5 runbook, followed literally: no step redoes a stage.

Every command of the section "On a Kimi-K2.5 node" (code blocks and inline commands, `$S` and
`$FT` expanded as its shell lines define them) is parsed by the stage script's own argument
parser and run against the production config it names, in order, with the Kimi-shaped
rehearsal verifier in place of the node's (the one setting every command gets alike, so that
the verifier's facts resolve here), through the stages' own resume checks
(`runs.depends_on` and `runs.config_changes`, what `Stage.require` and `Stage.check_done`
compare): each stage must find every stage it reads made with its settings, and a stage run a
second time must find its own output made with them too. Nothing runs an engine: a stage's
settings, not its work, decide whether the next command redoes it.
"""

from __future__ import annotations

import re
import shlex

from conftest import REPO
from eagle3.cli import _parse
from eagle3.config import load_config
from eagle3.runs import STAGES, all_upstream, config_changes, depends_on

PRODUCTION = "configs/kimi-k2.5.yaml"
STAGE_OF = {spec.script: n for n, spec in STAGES.items()}


def runbook_commands(readme: str) -> list[list[str]]:
    """The section's commands in reading order, as argument lists, variables expanded."""
    section = readme.split("## On a Kimi-K2.5 node", 1)[1].split("\n## ", 1)[0]
    pieces = re.findall(r"```bash\n(.*?)```|`((?:python|torchrun|bash) [^`]+)`", section,
                        flags=re.S)
    variables: dict[str, str] = {}
    commands = []
    for block, inline in pieces:
        text = (block or inline).replace("\\\n", " ")
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            assignment = re.fullmatch(r"([A-Z]+)=(.*)", line)
            if assignment:
                variables[assignment[1]] = shlex.split(assignment[2])[0]
                continue
            for name, value in variables.items():
                line = line.replace(f"${name}", value)
            commands.append(shlex.split(line))
    return commands


def stage_runs(argv: list[str]) -> list[tuple[int, list[str]]]:
    """(stage, the arguments after the script) of each stage a command runs."""
    if argv[:2] == ["bash", "run_pipeline.sh"]:
        rest = argv[2:]
        first = 1
        if len(rest) > 1 and re.fullmatch(r"[1-6]", rest[1]):
            first = int(rest.pop(1))
        return [(n, rest) for n in range(first, 7)]
    scripts = [i for i, a in enumerate(argv) if a in STAGE_OF]
    if not scripts:
        return []  # the plan, or a command of another tool
    i = scripts[0]
    if argv[i + 1:i + 2] == ["--from"]:
        return []  # 05_fix_keys.py --from converts a drafter directory: no stage of a run
    return [(STAGE_OF[argv[i]], argv[i + 1:])]


def follow(commands: list[list[str]], run_dir, verifier) -> tuple[list[str], list]:
    """Run `commands` through the stages' resume checks: (every refusal or redo, in order;
    the (run, stage) made by each stage run)."""
    made: dict[tuple[str, int], dict] = {}  # (run, stage) -> the settings it was made with
    problems, ran = [], []
    for argv in commands:
        for number, args in stage_runs(argv):
            assert args[0] == PRODUCTION, argv
            parsed, overrides = _parse("runbook", args, {}, smoke=number == 4)
            # Kimi's aux ids [2, 30, 58] do not fit the 8-layer stand-in: its own rule's.
            cfg = load_config(REPO / PRODUCTION, [f"run.dir={run_dir}",
                                                  f"verifier.path={verifier}",
                                                  "verifier.aux_layer_ids=null", *overrides])
            run = cfg.run.name
            where = f"`{shlex.join(argv)}` (stage {number:02d}, run {run})"
            if parsed.restart:
                problems.append(f"{where} restarts the stage")
            for up in all_upstream(number):
                if (run, up) not in made:
                    problems.append(f"{where} reads stage {up:02d}, which no step made")
                elif changes := config_changes(made[(run, up)], depends_on(cfg, up)):
                    problems.append(f"{where} refuses stage {up:02d}: {changes}")
            own = depends_on(cfg, number)
            if (run, number) in made and (changes := config_changes(made[(run, number)], own)):
                problems.append(f"{where} redoes stage {number:02d}: {changes}")
            if not getattr(parsed, "smoke", False):  # --smoke writes nothing
                made[(run, number)] = own
                ran.append((run, number))
    return problems, ran


def test_the_runbook_redoes_no_stage(tmp_path, kimi_verifier):
    commands = runbook_commands((REPO / "README.md").read_text())
    assert any(c[:2] == ["bash", "run_pipeline.sh"] for c in commands), commands
    assert any(c[0] == "torchrun" for c in commands), commands
    problems, ran = follow(commands, tmp_path, kimi_verifier)
    assert not problems, "\n".join(problems)
    # The smoke run and the full run each made stages 01-06.
    runs = {r for r, _ in ran}
    assert len(runs) == 2 and set(ran) == {(r, n) for r in runs for n in range(1, 7)}, ran


def test_the_check_fails_a_runbook_that_forgets_the_base_at_one_stage(tmp_path, kimi_verifier):
    """The runbook before its fix: stage 02 run without `--finetune-from` made a stage 02
    without the base's measure set, which stage 04's fine-tune refused."""
    readme = (REPO / "README.md").read_text()
    line = "python 02_extract_hidden_states.py configs/kimi-k2.5.yaml $S"
    broken = readme.replace(f"{line} $FT", line)
    assert broken != readme
    problems, _ = follow(runbook_commands(broken), tmp_path, kimi_verifier)
    assert problems and "(stage 04, run kimi-smoke) refuses stage 02" in problems[0], problems
    assert "train.finetune_from (base_aux_convention=measure)" in problems[0], problems
