"""A progress bar for the package's commands (the benchmark report, the training command)."""

from __future__ import annotations

import sys
from typing import Optional


class Progress:
    """A progress bar over ``total`` steps on stderr: tqdm when installed, else one printed line
    ``[i/total] label`` every ``every`` steps and at the last.  Nothing shows when not ``enabled``
    (a training rank other than the first)."""

    def __init__(self, total: int, *, desc: Optional[str] = None, unit: str = "it", every: int = 1,
                 enabled: bool = True) -> None:
        self.total, self.count, self.every, self.enabled = total, 0, max(1, every), enabled
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)

    def begin(self, label: str) -> None:
        """Step ``count + 1`` starts: show ``label``."""
        self.count += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label)
        elif self.enabled and (self.count % self.every == 0 or self.count == self.total):
            print(f"[{self.count}/{self.total}] {label}", file=sys.stderr, flush=True)

    def end(self) -> None:
        if self.bar is not None:
            self.bar.update()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
