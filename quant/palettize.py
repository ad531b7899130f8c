"""Palettized weights: a 2**bits-entry LUT of k-means centroids per group of output channels (weight rows) and
a code per weight, held in torchao's codebook tensor (codebook_coreml), whose dequantize op a backend may take
whole as a LUT decompression. The LUTs are fitted here, all of a weight's groups at once: the fit torchao calls
runs one scikit-learn k-means per group after another, hours for a model at small groups. The
tensor gains a cast (torchao's `to` passes the dtype twice) that casts the LUTs too, and row slices of whole
LUT groups, so that a linear split into row blocks (models/static_llama.py) keeps each block's own LUTs."""
from __future__ import annotations

import torch
from torchao.prototype.quantization.codebook_coreml.codebook_quantized_tensor import CodebookQuantizedTensor

KMEANS_ITERATIONS = 60  # an upper bound: Lloyd's steps shrink as it converges
ROWS_AT_ONCE = 4096  # rows of a weight fitted at once: the sort and assignments hold a few copies of them


class PalettizedTensor(CodebookQuantizedTensor):
    @classmethod
    def from_float(cls, weight: torch.Tensor, code_dtype: torch.dtype, block_size: list[int]) -> PalettizedTensor:
        """block_size [rows per LUT, -1]: one LUT per that many output channels, over all input channels."""
        bits = {getattr(torch, f"uint{b}"): b for b in range(1, 8)}[code_dtype]
        rows = block_size[0]
        codebook, codes = [], []
        for start in range(0, weight.shape[0], max(rows, ROWS_AT_ONCE // rows * rows)):
            part = weight[start:start + max(rows, ROWS_AT_ONCE // rows * rows)]
            luts, part_codes = kmeans_luts(part.reshape(-1, rows * weight.shape[1]), 2 ** bits)
            codebook.append(luts)
            codes.append(part_codes.reshape(part.shape))
        codebook = torch.cat(codebook)[:, None, :, None]  # torchao's layout: [groups, 1, entries, 1]
        return cls(torch.cat(codes), codebook.to(weight.dtype), code_dtype, block_size, weight.shape,
                   dtype=weight.dtype)

    def to(self, *args, **kwargs):
        kwargs = self._get_to_kwargs(*args, **kwargs)
        dtype = kwargs.get("dtype", self.dtype)
        return PalettizedTensor(self.codes.to(kwargs["device"]), self.codebook.to(kwargs["device"], dtype),
                                self.code_dtype, self.block_size, self.shape, dtype=dtype)


def kmeans_luts(groups: torch.Tensor, entries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means in one dimension on each row of `groups` [n, m], from evenly spaced quantiles, with the
    group's smallest and largest values kept as the first and last entries: (centroids [n, entries] ascending,
    the code of each value [n, m] as uint8). A free k-means averages a group's few outliers into a centroid far
    from them, and an LLM's rare large weights are the ones it can least afford to lose. In one dimension a
    cluster is a run of the sorted values between the midpoints of neighbouring centroids, so an iteration finds
    those runs by binary search and their means from prefix sums, never visiting every value."""
    values = groups.detach().float()
    ordered = values.sort(dim=1).values
    prefix = torch.nn.functional.pad(ordered.double().cumsum(dim=1), (1, 0))
    size = values.shape[1]
    centroids = ordered[:, torch.linspace(0, size - 1, entries).round().long()].double()
    low, high = centroids[:, :1], centroids[:, -1:]
    for _ in range(KMEANS_ITERATIONS):
        cuts = torch.searchsorted(ordered, ((centroids[:, 1:] + centroids[:, :-1]) / 2).float())
        edges = torch.cat([torch.zeros_like(cuts[:, :1]), cuts, torch.full_like(cuts[:, :1], size)], dim=1)
        counts = edges[:, 1:] - edges[:, :-1]
        sums = prefix.gather(1, edges[:, 1:]) - prefix.gather(1, edges[:, :-1])
        updated = torch.where(counts > 0, sums / counts.clamp(min=1), centroids)
        updated = torch.cat([low, updated[:, 1:-1], high], dim=1)
        if torch.equal(updated, centroids):
            break
        centroids = updated
    centroids = centroids.float()
    codes = torch.searchsorted((centroids[:, 1:] + centroids[:, :-1]) / 2, values.contiguous(), right=True)
    return centroids, codes.to(torch.uint8)


@PalettizedTensor.implements([torch.ops.aten.slice.Tensor])
def _rows(func, types, args, kwargs):
    tensor, dim, start, stop, step = (*args, *[None] * (5 - len(args)))[:5]
    rows, lut_rows = tensor.shape[0], tensor.block_size[0]
    start, stop = start or 0, min(rows if stop is None else stop, rows)
    if dim != 0 or (step or 1) != 1 or start % lut_rows or stop % lut_rows:
        raise NotImplementedError(f"a palettized weight slices whole LUT groups of rows only, got dim {dim}, "
                                  f"rows {start}:{stop}:{step} with {lut_rows} rows per LUT")
    codebook = tensor.codebook[start // lut_rows:stop // lut_rows]
    return PalettizedTensor(tensor.codes[start:stop], codebook, tensor.code_dtype, tensor.block_size,
                            torch.Size((stop - start, *tensor.shape[1:])), dtype=tensor.dtype)
