"""The batches of the exchange jobs (exchange_nodes.py, hosts_job.py): one tensor, again and
again; a slow rank's batches come `delay_s` late from step 11 on, so it enters every
all-reduce late."""
import time

import torch


class Batches:
    def __init__(self, slow: bool, delay_s: float):
        self.slow, self.delay_s, self.step = slow, delay_s, 0
        self.x = torch.randn(32, 64)

    def __iter__(self):
        return self

    def __next__(self):
        self.step += 1
        if self.slow and self.step > 10:
            time.sleep(self.delay_s)
        return self.x
