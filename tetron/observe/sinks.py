"""Where rank 0's step records go besides metrics.jsonl: TensorBoard event files, Weights & Biases.

Each sink takes the same records as metrics.jsonl, under the same names (`loss`, `val_loss`, `lr`,
`grad_norm`, `tokens_per_s`, `mfu`, `peak_mem_mb`, `time_dp_s`, ...), at the same step numbers; values
that are not numbers (None, a flag) are left out. Both libraries are imported only when asked for:
W&B is an optional extra (`pip install tetron[wandb]`), and it honours its own settings
(WANDB_MODE=offline, WANDB_DIR, an API key) as it finds them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

from tetron.config import Config
from tetron.errors import ConfigError


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite numbers, the step itself left out (it is the x axis)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class Sink(Protocol):
    def write(self, step: int, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Event files under OUT/tensorboard (`tensorboard --logdir OUT/tensorboard`). A resumed run purges the
    earlier attempt's events from its first step on, as metrics.jsonl drops them."""

    def __init__(self, folder: Path, *, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder), purge_step=first_step if first_step > 1 else None)

    def write(self, step: int, record: dict[str, Any]) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()  # a killed run keeps its curves, like its metrics.jsonl

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One W&B run per launch in `project`, its config the run's, its files under OUT/wandb."""

    def __init__(self, project: str, cfg: Config) -> None:
        import wandb

        out = Path(cfg.out)
        try:
            self.run = wandb.init(project=project, name=out.name, dir=str(out), config=cfg.to_dict())
        except wandb.errors.Error as err:  # not logged in, no network, a bad project name
            raise ConfigError(f"logging.wandb={project}: W&B did not start ({err}); run `wandb login`, set "
                               f"WANDB_MODE=offline, or unset logging.wandb") from None

    def write(self, step: int, record: dict[str, Any]) -> None:
        self.run.log(scalars(record), step=step)

    def close(self) -> None:
        self.run.finish()


def check_wandb(cfg: Config) -> None:
    """Before any rank starts: logging.wandb online needs credentials (WANDB_API_KEY, ~/.netrc from `wandb
    login`); offline or disabled mode (WANDB_MODE, wandb's settings) needs none. Asked of wandb's own loader,
    without the network and without prompting; where this wandb version has none, wandb.init says it later."""
    project = cfg.logging.wandb
    if not project:
        return
    import wandb

    settings = wandb.setup().settings
    if settings.mode in ("offline", "dryrun", "disabled"):
        return
    try:
        from wandb.sdk.lib.wbauth.authenticate import authenticate_session
    except ImportError:
        return
    try:
        found = authenticate_session(host=settings.base_url, source="tetron", prompt=False, update_session=False)
    except wandb.errors.Error as err:  # credentials found but malformed
        found, why = None, str(err).splitlines()[0]
    else:
        why = "no W&B credentials here (WANDB_API_KEY, or ~/.netrc from `wandb login`)"
    if found is None:
        raise ConfigError(f"logging.wandb={project}: {why}; run `wandb login`, set WANDB_MODE=offline (and `wandb "
                          f"sync` later), or unset logging.wandb")


def open_sinks(cfg: Config, *, first_step: int) -> list[Sink]:
    """The sinks logging.tensorboard and logging.wandb ask for; `first_step` is the first step this launch
    writes (1-based)."""
    sinks: list[Sink] = []
    if cfg.logging.tensorboard:
        sinks.append(TensorBoardSink(Path(cfg.out) / "tensorboard", first_step=first_step))
    if cfg.logging.wandb:
        sinks.append(WandbSink(cfg.logging.wandb, cfg))
    return sinks
