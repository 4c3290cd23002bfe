"""The multi-GPU tutorial's workflow, written for minidp.

The tutorial's steps, each marked below:
  1. choose the GPUs: CUDA_VISIBLE_DEVICES="0,4", then logical ids [0, 1];
  2. put the network on the GPU: .cuda() / .to(device);
  3. move each dict batch (data['image'], data['label']) to the GPU;
  4. bring tensors back with .cpu() before .numpy() (and before plotting);
  5. parallelise inside forward: data_parallel(self.features, x, ids), data_parallel(self.classifier, x, ids).

With one GPU it runs two replicas on it (ids [0, 0], each replica on its own CUDA stream); without a
GPU, two replicas on the CPU (ids ['cpu', 'cpu']), which stock torch.nn.parallel.data_parallel cannot do.

    python examples/tutorial_multi_gpu.py [--epochs 2] [--samples 3000] [--batch-size 64]
"""

import argparse
import os

# Step 1: which GPUs this process may see. It must be set before torch first touches CUDA. Under "0,4"
# the process sees two GPUs, which it calls 0 and 1: ids [0, 1] are the machine's GPUs 0 and 4. On a machine
# without a GPU 4 (fewer than five), CUDA stops reading the list there and the process sees GPU 0 alone.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0,4")

import torch  # noqa: E402  (after CUDA_VISIBLE_DEVICES, on purpose)
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import minidp  # noqa: E402
from minidp.digits import SyntheticDigits  # noqa: E402

if torch.cuda.device_count() >= 2:
    ids, device = [0, 1], torch.device("cuda:0")
elif torch.cuda.device_count() == 1:
    ids, device = [0, 0], torch.device("cuda:0")  # two replicas on the one GPU
else:
    ids, device = ["cpu", "cpu"], torch.device("cpu")  # two replicas on the CPU


class VGG(nn.Module):
    """A small VGG-style network. Step 5: its forward splits each batch over ``ids`` twice."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Linear(32 * 7 * 7, 64), nn.ReLU(), nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x = self.features(x)
        x = minidp.data_parallel(self.features, x, ids)
        x = x.view(x.size(0), -1)
        # x = self.classifier(x)
        x = minidp.data_parallel(self.classifier, x, ids)
        return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    if min(args.epochs, args.samples, args.batch_size) < 1:
        parser.error("--epochs, --samples and --batch-size must be at least 1")
    torch.manual_seed(0)
    print(f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}, ids={ids}, parameters on {device}")

    train_loader = DataLoader(SyntheticDigits(args.samples, seed=0), batch_size=args.batch_size, shuffle=True)
    test_set = SyntheticDigits(max(1, args.samples // 4), seed=1)

    # Step 2: the tutorial's cnn.cuda(): the parameters go to ids[0], where data_parallel expects them.
    cnn = VGG().to(device)
    optimizer = torch.optim.Adam(cnn.parameters(), lr=2e-3)
    loss_func = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        epoch_loss = 0.0
        for i, data in enumerate(train_loader):
            # Step 3: the batch is a dict; move its tensors to the device (Variable(...) is no longer needed).
            image = data["image"].float().to(device)
            label = data["label"].long().to(device)
            output = cnn(image)
            loss = loss_func(output, label)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            epoch_loss += loss.item()

        # Step 4: numpy only sees CPU memory, so .cpu() before .numpy() (a no-op for a CPU tensor).
        with torch.no_grad():
            test_output = cnn(test_set.images.to(device))
        pred_y = torch.max(test_output, 1)[1].data.cpu().numpy()
        test_label = test_set.labels.numpy()
        accuracy = float((pred_y == test_label).astype(int).sum()) / float(len(test_label))
        print(f"epoch {epoch + 1}: mean loss {epoch_loss / (i + 1):.4f}, test accuracy {accuracy:.1%}")

    print("Which devices are these? `python -m minidp devices` (or minidp.devices() in Python) lists them with"
          " their logical and physical ids; `nvidia-smi` shows each GPU busy while this runs.")


if __name__ == "__main__":
    main()
