"""attention="custom": ExecuTorch's custom ops attend only to the filled part of a whole cache, causally from
input_pos[0]; a call may take fewer tokens than the cache holds (ExportOptions.tokens_per_call)."""
from __future__ import annotations

from models.attention.base import form
from models.attention.executorch_ops import ExecutorchOpsAttention


@form("custom")
class CustomSdpa(ExecutorchOpsAttention):
    def attend(self, q, k, v, start_pos, positions, mask):
        self.write_cache(k, v, start_pos)
        return self.attend_cache(q, start_pos)

    @classmethod
    def start_and_mask(cls, module, positions, input_pos, seq_len):
        return cls.checked_start(input_pos, seq_len, module.options, bounded=True), None
