"""The torch engine's device path (train_zoo.device), run on CPU: the code a GPU runs
(bf16 autocast, channels-last, batches gathered and augmented from device-resident
tensors) is the code tested here; only the device differs.

Tolerances: bf16 autocast rounds the inputs of each convolution and matrix product to
bfloat16 (unit roundoff 2^-8) and accumulates in float32, so a pass differs from the
float32 one by gamma(2 L, 2^-8) on the result's scale, L the layers on the longest path
(a rounded weight and a rounded input per layer), plus the float32 pass's own deep_rtol;
the cross-entropy moves by at most twice the largest logit change.
"""

from __future__ import annotations

import pytest
import torch
from rounding_bounds import deep_rtol, gamma
from zoo_helpers import run

from posteriorzoo.data import iterate_batches
from posteriorzoo.errors import InvalidOptionError
from train_zoo.data import load_training_data, train_transform
from train_zoo.device import CPU, TrainingDevice, check_device, resolve_device
from train_zoo.recipes import get_recipe
from train_zoo.spec import make_spec
from train_zoo.torch_engine import TorchSGD, evaluate, initial_model, torch_batches

U_BF16 = 2.0 ** -8
GPU_PATH = TrainingDevice("cpu", autocast=True, channels_last=True)


def _spec():
    return make_spec("resnet18-cifar100", dataset="digits", checkpoints=1, base_seed=3,
                     model_options={"width": 2, "in_channels": 1},
                     recipe_overrides={"epochs": 1, "batch_size": 32})


def test_resident_batches_are_the_arrays_batches():
    """Gathering and augmenting from tensors (a GPU's copy) gives the same batches: same
    order, same crops and flips (drawn from the same CPU generator)."""
    data = load_training_data("digits").train
    recipe = get_recipe("resnet18-cifar100")
    transform = train_transform(recipe, data)
    resident = (torch.from_numpy(data.images), torch.from_numpy(data.labels))
    plain = iterate_batches(data, 64, seed=5, epoch=2, transform=transform)
    moved = iterate_batches(data, 64, seed=5, epoch=2, transform=transform,
                            resident=resident)
    count = 0
    for (a, y), (b, z) in zip(plain, moved, strict=True):
        assert torch.equal(a, b) and torch.equal(y, z)
        count += 1
    assert count == -(-len(data) // 64)


def test_the_gpu_code_path_trains_on_cpu_within_bf16_rounding_of_float32():
    spec = _spec()
    data = load_training_data("digits")
    batch = next(iter(torch_batches(data, spec.recipe, seed=1, device=GPU_PATH)(0)))
    plain = initial_model(spec, 0)
    mixed = GPU_PATH.place(initial_model(spec, 0))
    assert mixed.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    images, labels = batch
    with torch.no_grad():
        reference = plain.eval()(images)
        with GPU_PATH.compute():
            logits = mixed.eval()(GPU_PATH.inputs(images)).float()
    assert logits.dtype == torch.float32
    layers = sum(isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)) for m in plain.modules())
    bound = gamma(2 * layers, U_BF16) + deep_rtol(plain, images)
    change = (logits - reference).abs().max() / reference.abs().max()
    assert 0 < change <= bound     # bf16 really ran: float32 would change nothing
    # A few steps of the stepper on that path: the loss is finite and every weight moves.
    stepper = TorchSGD(mixed.train(), spec.recipe, noise_seed=7, device=GPU_PATH)
    before = {k: v.clone() for k, v in mixed.state_dict().items()}
    batches = torch_batches(data, spec.recipe, seed=1, device=GPU_PATH)(0)
    for _, step_batch in zip(range(3), batches, strict=False):
        assert torch.isfinite(torch.tensor(stepper.step(step_batch, 0.05)))
    assert all(not torch.equal(before[name], value) for name, value in
               mixed.named_parameters())
    assert set(stepper.arrays()) == set(before)
    # evaluation on that path: the mean cross-entropy within twice the largest logit
    # change (bound x the largest logit, from the float32 pass) of the float32 one's
    loss, accuracy = evaluate(mixed, data.test, device=GPU_PATH)
    exact_loss, _ = evaluate(mixed, data.test)
    with torch.no_grad():
        test_images = torch.from_numpy(data.test.images).float() / 255
        largest = mixed.eval()(data_normalised(data.test, test_images)).abs().max()
    assert abs(loss - exact_loss) <= 2 * float(bound * largest)
    assert 0.0 <= accuracy <= 1.0


def data_normalised(dataset, images):
    from train_zoo.data import eval_transform

    return eval_transform(dataset)(images)


def test_plain_cpu_is_the_default_and_cuda_is_refused_in_one_line_without_a_gpu(
        tmp_path, capsys):
    assert resolve_device(None) is CPU and resolve_device("cpu").is_cpu_default
    assert not GPU_PATH.is_cpu_default
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(InvalidOptionError, match="sees no CUDA GPU"):
        check_device("cuda:0")
    with pytest.raises(InvalidOptionError, match="cpu, cuda or cuda:N"):
        check_device("mps")
    spec = tmp_path / "de.toml"
    spec.write_text('recipe = "optunet-mnist"\ndataset = "digits"\ncheckpoints = 2\n')
    code, _, err = run(capsys, "train", spec, "--out", tmp_path / "z.h5", "--device", "cuda",
                       "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "sees no CUDA GPU" in err
    assert not (tmp_path / "z.h5").exists()


def test_numba_engines_are_refused_off_the_plain_cpu_path():
    from train_zoo.job import resolve_engine

    spec = make_spec("optunet-mnist", dataset="digits", checkpoints=1)
    assert resolve_engine(spec, "auto", GPU_PATH) == "torch"
    with pytest.raises(InvalidOptionError, match="fast engine trains on CPU in float32"):
        resolve_engine(spec, "fast", GPU_PATH)
