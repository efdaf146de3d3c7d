"""``mpitrain sample`` and ``mpitrain eval`` on a trained run (:mod:`mpitrain.train.trained`);
from every layout, under MPI: ``tests/test_mpi_trained.py``."""

import importlib.util
import json
import shutil

import numpy as np
import pytest
from test_checkpoint import gpt, lenet, quiet
from test_data import image_set

from mpitrain import checkpoint, cli, train
from mpitrain.observe.metrics import read as read_metrics


@pytest.fixture
def gpt_run(text_data, tmp_path):
    run = tmp_path / "gpt"
    train.train(gpt(text_data, run, "train.steps=8", "train.eval_batches=0"), log=quiet)
    return run


def test_sample_continues_the_prompt_from_the_runs_vocabulary_the_same_for_the_same_seed(gpt_run, capsys):
    texts = []
    for seed in (3, 3, 4):
        assert cli.main(["sample", str(gpt_run), "--prompt", "to be", "--tokens", "40", "--seed", str(seed)]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] != texts[2]
    text = texts[0].removesuffix("\n")
    assert text.startswith("to be") and len(text) == len("to be") + 40
    assert set(text) <= set("to be or not that is the question\n")  # the run's data: its words only


def test_eval_prints_the_runs_final_figure_from_a_run_directory_or_a_checkpoint_file(gpt_run, capsys):
    final = [r for r in read_metrics(gpt_run / "metrics.jsonl") if r.get("kind") == "eval"][-1]["val_loss"]
    for target in (gpt_run, checkpoint.path_for(gpt_run, 8)):
        assert cli.main(["eval", str(target), "--json"]) == 0
        figures = json.loads(capsys.readouterr().out)
        assert figures == {"checkpoint": str(checkpoint.path_for(gpt_run, 8)), "step": 8, "split": "val",
                           "loss": final}
    assert cli.main(["eval", str(gpt_run)]) == 0
    assert capsys.readouterr().out.startswith(f"step 8: val loss {final:.4f}\n")


def test_a_smoothed_run_learns_otherwise_and_eval_gives_its_final_figure(text_data, tmp_path, capsys):
    """``train.label_smoothing`` changes what the run learns and says so; ``mpitrain eval``
    gives the figure its last evaluation printed (both score the one-hot targets: the
    schedules' ``loss_only``, ``test_schedule.py`` and ``test_pipeline_stage.py``)."""
    plain = train.train(gpt(text_data, tmp_path / "plain", "train.steps=8"), log=quiet)
    lines = []
    run = tmp_path / "smooth"
    smooth = train.train(gpt(text_data, run, "train.steps=8", "train.label_smoothing=0.1"), log=lines.append)
    assert lines[0].splitlines()[0] == f"run directory: {run} (checkpoints, metrics.jsonl)"
    assert lines[0].splitlines()[1].endswith("; training labels smoothed by 0.1")
    assert smooth.val_loss != plain.val_loss and smooth.final_loss != plain.final_loss
    assert cli.main(["eval", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == smooth.val_loss


def test_eval_of_an_image_run_gives_accuracy_and_sample_refuses_it_in_one_line(tmp_path, capsys):
    image_set(tmp_path / "d", n=256, test=64)
    train.train(lenet(tmp_path / "d", tmp_path / "cnn", "train.epochs=1"), log=quiet)
    assert cli.main(["eval", str(tmp_path / "cnn"), "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["split"] == "test" and 0 <= figures["accuracy"] <= 1 and figures["loss"] > 0
    assert cli.main(["sample", str(tmp_path / "cnn")]) == 2
    assert "is an image dataset: sample draws text from a GPT run" in capsys.readouterr().err


def test_eval_flip_scores_the_mean_of_each_images_and_its_mirrors_probabilities(tmp_path, capsys):
    """``--flip`` (``train.eval_flip``): each test image's prediction is the mean of its
    and its training-time mirror's softmax; computed here directly, in float64."""
    from mpitrain.comm import SingleComm
    from mpitrain.data.loader import normalize, random_flip
    from mpitrain.tensor import Tensor, no_grad
    from mpitrain.train import trained

    x, y = image_set(tmp_path / "d", n=256, test=64)
    train.train(lenet(tmp_path / "d", tmp_path / "cnn", "train.epochs=1", "train.dtype=float64", "data.flip=true"),
                log=quiet)
    assert cli.main(["eval", str(tmp_path / "cnn"), "--json", "--flip"]) == 0
    flipped = json.loads(capsys.readouterr().out)
    assert cli.main(["eval", str(tmp_path / "cnn"), "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert flipped["flip"] and not plain["flip"] and flipped["loss"] != plain["loss"]

    run, _, _ = trained.load(tmp_path / "cnn", SingleComm(), quiet)
    run.model.eval()
    probabilities = []
    with no_grad():
        for view in (x[:64], random_flip(x[:64], np.ones(64, bool))):
            z = run.role.schedule.forward_only(Tensor(normalize(view, run.data.mean, run.data.std, np.float64))).data
            e = np.exp(z - z.max(axis=1, keepdims=True))
            probabilities.append(e / e.sum(axis=1, keepdims=True))
    run.close()
    p = (probabilities[0] + probabilities[1]) / 2  # (64, 10)
    assert flipped["accuracy"] == np.mean(p.argmax(axis=1) == y[:64])
    assert flipped["loss"] == pytest.approx(-np.log(p[np.arange(64), y[:64]]).mean(), rel=1e-12)
    assert cli.main(["eval", str(tmp_path / "cnn")]) == 0  # and the printed line says what was scored
    assert capsys.readouterr().out.startswith(f"step 4: test accuracy {100 * plain['accuracy']:.2f}%")
    assert cli.main(["eval", str(tmp_path / "cnn"), "--flip"]) == 0
    assert ", each image and its mirror\n" in capsys.readouterr().out
    train.train(lenet(tmp_path / "d", tmp_path / "unflipped", "train.epochs=1"), log=quiet)
    assert cli.main(["eval", str(tmp_path / "unflipped"), "--flip"]) == 2  # it never saw a mirrored image
    assert "train.eval_flip: scores each image's mirror too, which the model sees in training only with " \
           "data.flip = true, got True\n" in capsys.readouterr().err


def test_a_run_that_scores_two_views_says_so_in_its_records_report_and_tensorboard(tmp_path):
    """``train.eval_flip`` during a run: the metrics' evaluations carry ``flip``, the
    report's summary names the two views, and TensorBoard files them under their own tags."""
    from mpitrain.observe.report import report

    image_set(tmp_path / "d", n=256, test=64)
    tensorboard = importlib.util.find_spec("tensorboardX") is not None
    train.train(lenet(tmp_path / "d", tmp_path / "cnn", "train.epochs=2", "data.flip=true", "train.eval_flip=true",
                      f"run.tensorboard={str(tensorboard).lower()}"), log=quiet)
    evals = [r for r in read_metrics(tmp_path / "cnn" / "metrics.jsonl") if r.get("kind") == "eval"]
    assert len(evals) == 2 and all(r["flip"] is True for r in evals)
    lines = []
    report([tmp_path / "cnn"], log=lines.append)
    assert f"evaluation at step 8: test accuracy {100 * evals[-1]['test_accuracy']:.2f}% (each image and its " \
           "mirror)" in "\n".join(lines)
    if tensorboard:
        from test_tensorboard import scalars

        tags = scalars(tmp_path / "cnn")
        assert [s for s, _ in tags["eval/test_accuracy_flip"]] == [4, 8] and "eval/test_accuracy" not in tags


def test_eval_and_sample_run_with_the_runs_blas_threads_and_fast_paths(gpt_run, tmp_path, monkeypatch, capsys):
    """As the run ran: its BLAS threads per rank (unlimited, each rank of ``mpiexec -n 2``
    took a thread per core, and ``mpitrain eval`` of the CIFAR job took 3 min, not 13 s)
    and its fast paths."""
    import contextlib

    from mpitrain import ops
    from mpitrain.train import evaluate, trained

    seen = []

    @contextlib.contextmanager
    def limit(n):
        seen.append(("threads", n, ops.fast_paths_enabled()))
        yield

    monkeypatch.setattr(trained, "limit_blas_threads", limit)
    score = evaluate.score
    monkeypatch.setattr(evaluate, "score", lambda *a, **k: seen.append(("paths", ops.fast_paths_enabled())) or
                        score(*a, **k))
    image_set(tmp_path / "d", n=256, test=64)
    train.train(lenet(tmp_path / "d", tmp_path / "plain", "train.epochs=1", "train.threads=2",
                      "train.fast_paths=false"), log=quiet)
    seen.clear()  # what the run's own evaluations saw
    assert cli.main(["eval", str(tmp_path / "plain")]) == 0
    assert cli.main(["sample", str(gpt_run), "--tokens", "4"]) == 0  # the GPT's run: train.threads = 1
    assert seen == [("threads", 2, True), ("paths", False), ("threads", 1, True)]
    capsys.readouterr()


def test_log_mean_probabilities_of_one_view_or_equal_views_is_the_log_softmax():
    from mpitrain.train.evaluate import log_mean_probabilities

    z = np.array([[1.0, 2.0, 3.0], [1000.0, 0.0, -1000.0]])
    expected = z - z.max(axis=1, keepdims=True) - np.log(np.exp(z - z.max(axis=1, keepdims=True)).sum(axis=1))[:, None]
    np.testing.assert_allclose(log_mean_probabilities(z), expected, rtol=1e-15, atol=1e-300)
    np.testing.assert_allclose(log_mean_probabilities(z, z), expected, rtol=1e-14, atol=1e-300)
    two = log_mean_probabilities(np.array([[0.0, 50.0]]), np.array([[50.0, 0.0]]))  # confident, opposite views
    np.testing.assert_allclose(two, np.log([[0.5, 0.5]]), rtol=1e-14)


def test_what_sample_and_eval_cannot_use_is_one_line(gpt_run, tmp_path, capsys, monkeypatch):
    for argv, said in [(["eval", str(tmp_path / "nothing")], "no such run directory or checkpoint file"),
                       (["eval", str(gpt_run), "--split", "test"], "has no split 'test' (it has ['train', 'val'])"),
                       (["sample", str(gpt_run), "--prompt", "€"], "--prompt: character '€' is not in the vocabulary"),
                       (["eval", str(tmp_path)], "no checkpoint of the run can be used"),
                       (["eval", str(gpt_run), "--flip"], "train.eval_flip: applies to image models only")]:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("mpitrain: error: ") and said in err and err.count("\n") == 1, err
    empty = tmp_path / "prompts.txt"
    empty.write_text("to be\n\nor not\n")
    for argv, said in [(["sample", str(gpt_run), "--tp", "2"], "--tp 2: the 1 rank(s) of this job do not divide by "
                        "it (run it on mpiexec -n 2 mpitrain sample ...)"),
                       (["sample", str(gpt_run), "--dp", "2"], "--dp 2: tp 1 x dp 2 = 2, but there are 1 rank(s)"),
                       (["sample", str(gpt_run), "--prompt", "to", "--prompt-file", str(empty)],
                        "--prompt and --prompt-file: give one of them"),
                       (["sample", str(gpt_run), "--prompt-file", str(empty)],
                        f"{empty}:2: an empty prompt (a prompt needs one character at least)"),
                       (["sample", str(gpt_run), "--prompt-file", str(tmp_path / "none.txt")],
                        f"--prompt-file {tmp_path / 'none.txt'}: No such file or directory"),
                       (["sample", str(gpt_run), "--prompt-file", str(empty), "--batch", "2"],
                        "--batch 2 repeats --prompt; with --prompt-file each line is a prompt")]:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("mpitrain: error: ") and said in err and err.count("\n") == 1, err


def test_a_saved_data_name_gives_way_to_a_data_path_set_and_back():
    """``mpitrain eval RUN --set data.path=DIR`` scores another dataset of the run's
    vocabulary (a fine-tune's held-out text) though the run named an embedded one."""
    from mpitrain.train.trained import elsewhere

    assert elsewhere({"name": "shakespeare", "sampling": "random"}, ["data.path=/d"]) == {"sampling": "random"}
    assert elsewhere({"path": "/d", "verify": True}, ["data.name = shakespeare"]) == {"verify": True}
    assert elsewhere({"name": "shakespeare"}, ["train.eval_batches=2"]) == {"name": "shakespeare"}



def test_eval_of_another_split_names_its_figures_by_it(gpt_run, capsys):
    """``--split train`` scores the training split and says ``train loss``, not ``val loss``."""
    assert cli.main(["eval", str(gpt_run), "--split", "train", "--batches", "1"]) == 0
    assert capsys.readouterr().out.startswith("step 8: train loss ")


def test_sample_and_eval_say_which_newer_checkpoint_they_passed_over_and_why(gpt_run, capsys):
    """Before: a damaged newest checkpoint was passed over in silence (the older file
    read was named, the skipped one was not)."""
    from test_checkpoint import damage

    newest, older = checkpoint.path_for(gpt_run, 8), checkpoint.path_for(gpt_run, 4)
    damage(newest, "flipped")
    for argv in (["sample", str(gpt_run), "--tokens", "3"], ["eval", str(gpt_run), "--batches", "1"]):
        assert cli.main(argv) == 0
        err = capsys.readouterr().err
        said = [line for line in err.splitlines() if line.startswith("warning: not read: ")]
        assert len(said) == 1 and str(newest) in said[0] and said[0].endswith(
            f"; reading {older}, the newest checkpoint that verifies"), err
    assert newest.exists()  # reading a run moves nothing
    other = gpt_run.parent / "other"  # a newer checkpoint of another run, copied in: named, not read
    train.train(gpt(gpt_run.parent / "shards", other, "train.steps=12", "train.seed=2"), log=quiet)
    shutil.copy(checkpoint.path_for(other, 12), checkpoint.directory(gpt_run))
    assert cli.main(["eval", str(gpt_run), "--batches", "1"]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: not read: ")]
    assert any(f"{checkpoint.path_for(gpt_run, 12)}: a checkpoint of another run (" in line for line in said), said
