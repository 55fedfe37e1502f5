"""The settings of a training run small enough for a unit test: the mlp on 256 synthetic images at batch 64 (4 steps
an epoch), no progress bar, one thread; each test adds its length and what it looks at."""

SMALL_RUN = dict(
    model="mlp",
    dataset="synthetic",
    train_subset=256,
    test_subset=64,
    batch_size=64,
    progress=False,
    threads=1,
)
