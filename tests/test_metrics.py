import copy
import math
from dataclasses import replace

import matplotlib.image
import pytest
import torch

from tasks.compare import curve_stage, differing_params, trained_fields
from tasks.reporting import (
    LEGEND_WIDTH,
    RunSummary,
    comparison_rows,
    eval_bars_figure,
    label_runs,
    markdown_table,
    plot_eval_bars,
    plot_training_curves,
    saved,
    spread_apart,
    training_curves_figure,
)
from trainers.data.rows import Truncation, tokenize_split
from trainers.data.synthetic import AdditionTask, generate_addition
from trainers.evaluation.evaluate import Completion, PromptResult, answer_metrics, preference_rewards
from trainers.scoring.metrics import bootstrap_ci, pass_at_k
from trainers.scoring.reference_pass import reference_logps

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 1, 1, 1 / 4),
        (4, 1, 2, 1 - 3 / 6),  # 1 - C(3,2)/C(4,2)
        (5, 2, 3, 1 - 1 / 10),  # 1 - C(3,3)/C(5,3)
        (10, 3, 4, 1 - 35 / 210),  # 1 - C(7,4)/C(10,4)
        (6, 0, 3, 0.0),
        (6, 6, 1, 1.0),
        (3, 1, 3, 1.0),  # k = n: any correct sample is drawn
    ],
)
def test_pass_at_k_closed_form(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_bootstrap_interval_is_reproducible_and_brackets_the_mean():
    values = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0] * 5
    first = bootstrap_ci(values, seed=7, resamples=500)
    assert first == bootstrap_ci(values, seed=7, resamples=500)
    assert first != bootstrap_ci(values, seed=8, resamples=500)
    mean = sum(values) / len(values)
    assert first[0] < mean < first[1]
    # the percentile interval of a 0/1 mean with p = 0.7, n = 50 is about ±1.96·sqrt(p(1-p)/n) = ±0.127
    assert first[1] - first[0] == pytest.approx(2 * 1.96 * math.sqrt(0.7 * 0.3 / 50), abs=0.04)
    assert bootstrap_ci([0.5] * 9, seed=0) == (0.5, 0.5)


def result(answer: str, greedy: str, samples: list[str]) -> PromptResult:
    return PromptResult("p", answer, Completion(greedy, len(greedy) + 1), [Completion(s, len(s) + 1) for s in samples])


def test_answer_metrics_by_hand():
    results = [
        result("12", "12", ["12", "13", "12", "2"]),  # greedy right, 2/4 samples right
        result("7", "8", ["7", "6", "5", "4"]),  # greedy wrong, 1/4
        result("30", "31", ["1", "2", "3", "4"]),  # 0/4
    ]
    metrics = answer_metrics(results, pass_ks=[1, 2, 4, 8], seed=0, resamples=200)
    assert metrics["greedy_accuracy"] == pytest.approx(1 / 3)
    assert metrics["sampled_accuracy"] == pytest.approx((2 / 4 + 1 / 4 + 0) / 3)
    assert metrics["pass_at_1"] == pytest.approx(metrics["sampled_accuracy"])
    assert metrics["pass_at_2"] == pytest.approx(((1 - 1 / 6) + (1 - 3 / 6) + 0) / 3)
    assert metrics["pass_at_4"] == pytest.approx(2 / 3)
    assert "pass_at_8" not in metrics  # more than the 4 samples drawn
    assert metrics["mean_completion_tokens"] == pytest.approx((3 + 3 + 3 + 2 + 2 + 2 + 2 + 2 + 2 + 2 + 2 + 2) / 12)
    assert metrics["greedy_accuracy_ci_low"] <= metrics["greedy_accuracy"] <= metrics["greedy_accuracy_ci_high"]


def summaries() -> list[RunSummary]:
    def run(run_id, beta, acc, low, high, losses):
        return RunSummary(
            run_id,
            "exp",
            {"dpo.beta": beta},
            {"sampled_accuracy": acc, "sampled_accuracy_ci_low": low, "sampled_accuracy_ci_high": high},
            {"loss": list(enumerate(losses))},
        )

    return [
        run("a" * 32, "0.1", 0.50, 0.45, 0.55, [0.7, 0.6, 0.5]),
        run("b" * 32, "0.5", 0.62, 0.57, 0.67, [0.7, 0.5, 0.3]),
        run("c" * 32, "1.0", 0.58, 0.52, 0.63, [0.7, 0.55, 0.45]),
    ]


def test_comparison_rows_and_deltas():
    runs = label_runs(summaries(), ["dpo.beta"])
    rows = comparison_rows(runs, runs[1], ["dpo.beta"], ["sampled_accuracy"])
    assert [r["run"] for r in rows] == ["exp (aaaaaaaa)", "exp (bbbbbbbb)", "exp (cccccccc)"]  # β has its column
    assert [r["baseline"] for r in rows] == ["", "yes", ""]
    assert [r["dpo.beta"] for r in rows] == ["0.1", "0.5", "1.0"]
    assert [r["Δ sampled_accuracy"] for r in rows] == pytest.approx([-0.12, 0.0, -0.04])
    table = markdown_table(rows)
    assert table.splitlines()[0] == "| run | baseline | dpo.beta | sampled_accuracy | Δ sampled_accuracy |"
    assert "| exp (bbbbbbbb) | yes | 0.5 | 0.620 | 0.000 |" in table


def test_curves_keep_one_colour_per_run_across_panels_and_share_one_legend():
    runs = label_runs(summaries(), ["dpo.beta"])
    for run in runs:
        run.curves["rewards/accuracies"] = [(0, 0.5), (1, 0.6)]
    figure = training_curves_figure(runs, ["loss", "rewards/accuracies"], "dpo")
    labels = [run.label for run in runs]
    assert labels == ["dpo.beta=0.1 (aaaaaaaa)", "dpo.beta=0.5 (bbbbbbbb)", "dpo.beta=1.0 (cccccccc)"]
    panels = figure.axes
    assert [axis.get_title() for axis in panels] == ["dpo: loss", "dpo: rewards/accuracies"]
    colours = [{line.get_label(): line.get_color() for line in axis.get_lines()} for axis in panels]
    assert colours[0] == colours[1] and len(set(colours[0].values())) == 3 and set(colours[0]) == set(labels)
    assert all(axis.get_legend() is None for axis in panels)
    (legend,) = figure.legends
    assert [text.get_text() for text in legend.get_texts()] == labels
    assert [handle.get_color() for handle in legend.legend_handles] == [colours[0][label] for label in labels]
    unlogged = training_curves_figure(runs, ["kl"], "dpo")
    assert [text.get_text() for text in unlogged.axes[0].texts] == ["not logged by dpo"]
    assert unlogged.legends == []
    untrained = replace(runs[2], curves={})  # a run that did not train DPO (a KTO run): no line, no entry
    (legend,) = training_curves_figure([*runs[:2], untrained], ["loss"], "dpo").legends
    assert [text.get_text() for text in legend.get_texts()] == labels[:2]


def test_a_panel_whose_runs_lie_ten_times_apart_is_drawn_on_a_log_axis():
    """A sweep over DPO losses: IPO's loss at β = 0.1 (~(1/(2β))² = 25) beside the sigmoid loss's
    (~0.69) would flatten the sigmoid runs on a linear axis."""
    runs = label_runs(summaries()[:2], ["dpo.beta"])
    runs[0].curves["loss"] = [(20, 0.69), (40, 0.60)]
    runs[1].curves["loss"] = [(20, 24.5), (40, 23.4)]
    runs[0].curves["kl"], runs[1].curves["kl"] = [(20, 0.5)], [(20, 4.9)]  # 9.8 times apart: linear
    runs[0].curves["margin"], runs[1].curves["margin"] = [(20, -0.1)], [(20, 30.0)]  # not all positive
    panels = training_curves_figure(runs, ["loss", "kl", "margin"], "dpo").axes
    assert [axis.get_yscale() for axis in panels] == ["log", "linear", "linear"]
    assert not spread_apart([[0.69, 0.6]])  # one run: nothing to set apart


def test_eval_bars_say_which_metric_no_run_measured():
    (axis,) = eval_bars_figure(summaries(), ["sampled_accuracy", "pass_at_4"]).axes
    assert [(text.get_text(), text.get_position()[0]) for text in axis.texts] == [("not measured", 1)]


def test_curves_come_from_the_first_stage_whose_settings_differ():
    params = [{"dpo.beta": "0.1", "sft.seed": "0", "name": "a"}, {"dpo.beta": "0.5", "sft.seed": "0", "name": "b"}]
    differing = differing_params(params)
    assert differing == ["name", "dpo.beta"]  # the top-level fields first
    assert curve_stage(["sft", "dpo", "grpo"], differing, "grpo") == "dpo"
    assert curve_stage(["sft", "dpo", "grpo"], ["name", "sft.seed", "grpo.beta"], "grpo") == "sft"
    assert curve_stage(["sft", "dpo", "grpo"], ["name"], "grpo") == "grpo"


def test_a_stages_settings_differ_only_between_the_runs_that_train_it():
    """The default run against an RLHF run (no DPO, a reward stage): their ``dpo.beta`` differ, but
    the RLHF run trained no DPO, so it has none; a second DPO run's β does differ from the default's."""
    default = {"name": "default", "stages": "['sft', 'dpo', 'grpo']", "seed": "0", "dpo.beta": "0.5"}
    default |= {"grpo.reward_funcs": "['correctness']", "compute.cpu": "False"}
    rlhf = {"name": "rlhf", "stages": "['sft', 'reward', 'grpo']", "seed": "0", "dpo.beta": "0.1"}
    rlhf |= {"grpo.reward_funcs": "['model:reward']", "reward.learning_rate": "1e-05", "compute.cpu": "True"}
    assert trained_fields([default, rlhf])[1] == {key: rlhf[key] for key in rlhf if key != "dpo.beta"}
    assert differing_params(trained_fields([default, rlhf])) == ["name", "stages", "compute.cpu", "grpo.reward_funcs"]
    beta = default | {"name": "beta", "dpo.beta": "0.1"}
    differing = differing_params(trained_fields([default, rlhf, beta]))
    assert differing == ["name", "stages", "compute.cpu", "dpo.beta", "grpo.reward_funcs"]
    kto = {"name": "kto", "stages": "['sft', 'kto']", "dpo.beta": "0.1", "grpo.reward_funcs": "['correctness']"}
    assert trained_fields([default, kto])[1] == {"name": "kto", "stages": "['sft', 'kto']"}  # its table cells: blank


def test_a_long_label_wraps_in_a_legend_under_the_panels_that_the_saved_file_holds(tmp_path):
    long = ", ".join(f"dpo.setting_{i}=value_{i}" for i in range(8))  # 207 characters
    runs = [replace(run, distinction=long) for run in summaries()[:2]]
    for figure in (training_curves_figure(runs, ["loss"], "dpo"), eval_bars_figure(runs, ["sampled_accuracy"])):
        (legend,) = figure.legends
        texts = [text.get_text() for text in legend.get_texts()]
        assert [text.replace("\n", " ") for text in texts] == [run.label for run in runs]
        assert max(len(line) for text in texts for line in text.splitlines()) <= LEGEND_WIDTH
        figure.canvas.draw()
        assert legend.get_window_extent().y1 <= figure.axes[0].get_tightbbox().y0  # under the panels
        path = saved(figure, tmp_path / "plot.png")
        assert matplotlib.image.imread(path).shape[0] > figure.get_figheight() * 110  # the file grew to hold the legend


def test_a_stages_curves_are_its_own_and_a_stage_this_process_does_not_know_gets_loss_and_grad_norm():
    from trainers.catalog import stage_curves

    assert stage_curves("grpo") == ("reward", "completions/mean_length")  # not DPO's, which GRPO never logs
    assert stage_curves("dpo") == ("loss", "rewards/accuracies")
    assert stage_curves("my_plugin_stage") == stage_curves("sft") == ("loss", "grad_norm")


def test_plots_are_written_as_images(tmp_path):
    runs = summaries()
    curves = matplotlib.image.imread(
        plot_training_curves(runs, ["loss", "rewards/accuracies"], tmp_path / "curves.png")
    )
    bars = matplotlib.image.imread(plot_eval_bars(runs, ["sampled_accuracy"], tmp_path / "bars.png"))
    assert curves.shape[0] > 300 and curves.shape[1] > 2 * curves.shape[0]  # two panels side by side
    assert bars.shape[0] > 300 and bars.shape[2] in (3, 4)


def naive_completion_logp(model, prompt_ids: list[int], completion_ids: list[int]) -> float:
    ids = torch.tensor([prompt_ids + completion_ids])
    logps = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
    positions = range(len(prompt_ids) - 1, ids.shape[1] - 1)
    return sum(logps[t, ids[0, t + 1]].item() for t in positions)


@torch.no_grad()
def test_held_out_reward_metrics_by_hand(tiny):
    """Accuracy and margin of the implicit rewards β·(π − ref) on held-out pairs, against the
    reference's cached log-probs: recomputed here row by row with a plain log-softmax."""
    model, tokenizer = tiny
    reference = copy.deepcopy(model)
    for parameter in reference.parameters():  # a reference that differs from the policy
        parameter.add_(0.05 * torch.randn_like(parameter, generator=torch.Generator().manual_seed(3)))
    rows = generate_addition(AdditionTask(max_operand=9, num_eval_problems=12))["preference_eval"]
    pairs, _ = tokenize_split(rows, "preference_eval", tokenizer, Truncation(32, 16))
    chosen, rejected = reference_logps(reference, tokenizer.pad_token_id, pairs, batch_size=5, progress=False)
    pairs = [dict(p, ref_chosen_logps=c, ref_rejected_logps=r) for p, c, r in zip(pairs, chosen, rejected)]

    beta = 0.5
    rewards = [
        (
            beta * (naive_completion_logp(model, p["prompt_ids"], p["chosen_ids"]) - p["ref_chosen_logps"]),
            beta * (naive_completion_logp(model, p["prompt_ids"], p["rejected_ids"]) - p["ref_rejected_logps"]),
        )
        for p in pairs
    ]
    got = preference_rewards(model, tokenizer, pairs, beta, batch_size=5)  # batches of 5, 5 and 2 pairs
    assert got["rewards/accuracies"] == pytest.approx(sum(c > r for c, r in rewards) / len(rewards), abs=1e-6)
    assert got["rewards/margins"] == pytest.approx(sum(c - r for c, r in rewards) / len(rewards), abs=1e-5)
    assert got["logratios/margins"] == pytest.approx(got["rewards/margins"] / beta, abs=1e-5)  # β-free
    assert 0 < got["rewards/accuracies"] < 1  # the case is not degenerate
