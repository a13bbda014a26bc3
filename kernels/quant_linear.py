"""Linear layers on quantized weights, and the plain-torch reference of each one's arithmetic.

- `Int8Linear`: int8 weights with one scale per output channel. W8A8 (`act_quant=True`): each token's
  activations quantized to int8 at run time (symmetric, s_x = amax / 127, round half to even), an exact integer
  sum, then `(float(acc) * s_x) * s_w`. W8A16 (`act_quant=False`): `(x @ float(q_w).T) * s_w`.
- `Int4Linear`: 4-bit weights in groups along the input dimension, `w = (u - z) * s` per group (u in [0, 15];
  without zero points z = 8), computed as `sum_g s_g * (x_g @ u_g.T) - sum_g s_g * z_g * sum(x_g)`: the weights'
  integers are multiplied as they are, the scale applied once per group.

Both sum in float32 whatever the model's dtype (a bf16 or float64 input is converted, the output converted back;
W4A16's kernel multiplies bf16 inputs as they are where the CPU has AVX512-BF16: their products are exact in
float32), add the bias in float32, and keep the checkpoint's integers as they are: the weights are never expanded to
a dense float matrix for a step. On CPU the compiled kernels (`kernels.quant_gemm`) run them; elsewhere, or
where the kernel cannot take a shape, `reference()` does, which is also what the kernels are tested against
(W8A8: equal bit for bit; the float paths: equal up to the order of the sums).
"""

from __future__ import annotations

import torch

from paged_hf.kernels import layer_ops, q4_panels, quant_gemm


class QuantizedLinear(torch.nn.Module):
    """What the quantized linears share: in_features, out_features, the model's dtype and an optional bias."""

    scheme = "quantized"
    #: switches flipped at run time (tests, the engine probe); a stack of linears follows its first one's
    modes = ("use_kernel",)

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype).clone())
        self.use_kernel = True  # False: always the torch reference (tests, debugging)

    def take_modes(self, other: QuantizedLinear) -> None:
        """Switch `modes` as `other` has them now."""
        for name in self.modes:
            setattr(self, name, getattr(other, name))

    def bias32(self) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel(x) if self.use_kernel and x.device.type == "cpu" else None
        if y is None:
            return self.reference(x)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def kernel(self, x: torch.Tensor) -> torch.Tensor | None:
        """[tokens, out] from the compiled code (float32, or already x's dtype), or None where it cannot serve x."""
        return None

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}, " \
               f"bias={self.bias is not None}"


class Int8Linear(QuantizedLinear):
    modes = ("use_kernel", "act_quant")

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 act_quant: bool, input_scale: torch.Tensor | None = None):
        """qweight [out, in] int8, scale [out] (any float dtype: kept as float32, exactly). `input_scale` [in]
        (SmoothQuant, loader/smoothing.py): the activations are multiplied by it before they are quantized, the
        weight was quantized divided by it, so the module still computes x W^T; None: x as it comes."""
        out_features, in_features = qweight.shape
        super().__init__(in_features, out_features, bias, dtype)
        padded = -(-in_features // 16) * 16  # the kernel reads 16 at a time: zeros past in_features
        q = torch.zeros(out_features, padded, dtype=torch.int8)
        q[:, :in_features] = qweight
        self.register_buffer("qweight", q)
        self.register_buffer("weight_scale", scale.detach().reshape(out_features).float().clone())
        self.register_buffer("input_scale", None if input_scale is None else input_scale.detach().float().clone())
        self.act_quant = act_quant
        self.scheme = "w8a8" if act_quant else "w8a16"

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        """x times `input_scale` (in float32, back in x's dtype), or x."""
        return x if self.input_scale is None else (x.float() * self.input_scale).to(x.dtype)

    def kernel(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.act_quant and x.dtype == torch.bfloat16:  # the smoothing, the widening and bf16 out in one call
            return quant_gemm.w8a8(x, self.qweight, self.weight_scale, self.bias32(), self.in_features,
                                   input_scale=self.input_scale)
        run = quant_gemm.w8a8 if self.act_quant else quant_gemm.w8a16
        scaled = None if self.input_scale is None else layer_ops.scale_rows(x, self.input_scale)  # one pass
        return run(self._scaled(x) if scaled is None else scaled, self.qweight, self.weight_scale, self.bias32(),
                   self.in_features)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        x32 = self._scaled(x).reshape(-1, self.in_features).float()
        q_w = self.qweight[:, :self.in_features]
        if self.act_quant:
            q_x, s_x = quantize_tokens(x32)
            acc = (q_x.long() @ q_w.long().T).float()  # exact integer sums
            y = (acc * s_x[:, None]) * self.weight_scale[None, :]
        else:
            y = (x32 @ q_w.float().T) * self.weight_scale[None, :]
        if self.bias is not None:
            y = y + self.bias32()
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


class Int4Linear(QuantizedLinear):
    scheme = "w4a16"
    modes = ("use_kernel", "act_quant")

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                 bias: torch.Tensor | None, dtype: torch.dtype, act_quant: bool = False):
        """values [out, in] integers in [0, 15] (any int dtype), scales [out, in / group_size], zeros likewise
        (None: symmetric, z = 8). `act_quant` (W4A8, kernels/q4_panels.py): the activations quantized per block of
        32 to int8, the weights kept repacked in panels of 16 channels (`qweight`, `scales`, `zeros` in that layout,
        the last two float16, in place of the row-major ones; `panels`); where the sizes do not allow panels
        (`q4_panels.fits`): a ValueError. `act_quant` switched off later (the engine probe) computes W4A16's
        arithmetic on the panels (by the torch reference)."""
        out_features, in_features = values.shape
        if in_features % group_size or group_size % 2:
            raise ValueError(f"a group size of {group_size} does not divide in_features={in_features}")
        if act_quant and not q4_panels.fits(out_features, in_features, group_size):
            raise ValueError(f"W4A8 needs out_features % 16 == 0 and whole 32-blocks, got {out_features}x"
                             f"{in_features} in groups of {group_size}")
        super().__init__(in_features, out_features, bias, dtype)
        self.group_size, self.act_quant, self.panels = group_size, act_quant, act_quant
        self.scheme = "w4a8" if act_quant else "w4a16"
        scales = scales.detach().float().reshape(out_features, -1)
        z = torch.full_like(scales, 8.0) if zeros is None else zeros.detach().float().reshape(out_features, -1)
        if act_quant:
            self.register_buffer("qweight", q4_panels.repack(values))
            scales, z = q4_panels.half_groups(scales), q4_panels.half_groups(z)
        else:
            self.register_buffer("qweight", pack_int4(values))
        self.register_buffer("scales", scales.clone())
        self.register_buffer("zeros", z.clone())
        self.has_zero_points = zeros is not None

    def kernel(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.panels:
            return q4_panels.linear(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias) \
                if self.act_quant else None
        return quant_gemm.w4a16(x, self.qweight, self.scales, self.scaled_zeros(), self.group_size, self.bias32())

    def scaled_zeros(self) -> torch.Tensor:
        if getattr(self, "_scaled_zeros", None) is None or self._scaled_zeros.device != self.scales.device:
            _, scales, zeros = self.unpacked()
            self._scaled_zeros = (scales * zeros).contiguous()  # [out, groups]
        return self._scaled_zeros

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(values [out, in] uint8, scales, zeros [out, groups] float32) in the row-major layout."""
        if self.panels:
            return (q4_panels.unrepack(self.qweight, self.in_features), q4_panels.unrepack_groups(self.scales).float(),
                    q4_panels.unrepack_groups(self.zeros).float())
        return unpack_int4(self.qweight, self.in_features), self.scales, self.zeros

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.reshape(-1, self.in_features).float()
        if self.act_quant:
            y = q4_panels.reference(x32, *self.unpacked(), self.group_size)
            if self.bias is not None:
                y = y + self.bias32()
            return y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        values, scales, zeros = self.unpacked()
        # panels (W4A8 switched off, as by the engine probe): made here and dropped, not kept beside the panels
        # (they were 100 MB on a 1B model); W4A16's kernel reads its kept ones at every call
        scaled_zeros = (scales * zeros).contiguous() if self.panels else self.scaled_zeros()
        groups, size = scales.shape[1], self.group_size
        u = values.float()  # [out, in]: integers, exactly
        y = torch.zeros(x32.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        for g in range(groups):
            y += (x32[:, g * size:(g + 1) * size] @ u[:, g * size:(g + 1) * size].T) * scales[:, g]
        y = y - quant_gemm.zero_point_part(x32, scaled_zeros, size)
        if self.bias is not None:
            y = y + self.bias32()
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}, zero_points={self.has_zero_points}"


# --- the arithmetic's pieces ------------------------------------------------------------------------------------

def quantize_tokens(x32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8 of x32 [m, k] float32: (q [m, k] float32 holding integers in [-127, 127],
    scales [m] float32), as the compiled kernel computes them."""
    amax = x32.abs().amax(-1)
    # a tensor over a tensor: one rounded division, as the kernel's; `127.0 / amax` is torch's reciprocal times 127,
    # a second rounding that moves a product off (or onto) a .5 now and then
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(x32 * inv[:, None]).clamp(-127, 127)
    return q, amax / 127.0


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric int8 per output channel of weight [out, in]: (q int8, scale [out] float32),
    scale = amax / 127 (1 for an all-zero row)."""
    w = weight.detach().float()
    amax = w.abs().amax(-1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def quantize_int4_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric 4-bit of weight [out, in] in groups of `group_size` along in (GPTQ's and AWQ's
    min/max rule without calibration): (values [out, in] uint8 in [0, 15], scales and zeros [out, groups] float32),
    w ~ (u - z) * s."""
    n, k = weight.shape
    view = weight.detach().float().view(n, k // group_size, group_size)
    low, high = view.amin(-1).clamp(max=0), view.amax(-1).clamp(min=0)
    scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    zeros = torch.round(-low / scales).clamp(0, 15)
    values = torch.clamp(torch.round(view / scales[:, :, None]) + zeros[:, :, None], 0, 15)
    return values.view(n, k).to(torch.uint8), scales, zeros


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """values [n, k] in [0, 15] -> [n, k / 2] uint8, in blocks of 32 along k: byte j of a block holds k = j
    (low nibble) and k = 16 + j (high nibble). k not a multiple of 32: the last block zero padded."""
    n, k = values.shape
    v = values.to(torch.uint8)
    padded = -(-k // 32) * 32
    if padded != k:
        v = torch.cat([v, torch.zeros(n, padded - k, dtype=torch.uint8)], 1)
    blocks = v.view(n, padded // 32, 2, 16)
    packed = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, padded // 2)
    return packed[:, :k // 2].contiguous() if padded != k else packed.contiguous()


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """pack_int4's inverse: [n, k] uint8 values in [0, 15]."""
    n = packed.shape[0]
    padded = -(-k // 32) * 32
    p = packed if padded == k else torch.cat([packed, torch.zeros(n, (padded - k) // 2, dtype=torch.uint8)], 1)
    blocks = p.view(n, padded // 32, 1, 16)
    values = torch.cat([blocks & 15, blocks >> 4], 2).reshape(n, padded)
    return values[:, :k]


def dequantize_int4(packed: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 weight [n, k] the reference multiplies: (u - z) * s, each element rounded once."""
    n, groups = scales.shape
    k = groups * group_size
    u = unpack_int4(packed, k).float().view(n, groups, group_size)
    return ((u - zeros[:, :, None]) * scales[:, :, None]).view(n, k)


def stack_linears(linears: list[torch.nn.Module]) -> QuantizedLinear | None:
    """One quantized linear computing `linears` (reading the same input) side by side, their outputs concatenated:
    each output channel's arithmetic is its own linear's, so the outputs are bit for bit the separate calls'. None
    where they cannot share a call (not all quantized the same way, other sizes, group sizes or input scales).
    The weights are not held twice: each linear's buffers become row slices of the stack's (the same values,
    contiguous, what the linear computes unchanged). Its `modes` are the first linear's when made: `take_modes`
    switches them as the linears' are switched later."""
    if not stackable(linears):
        return None
    first = linears[0]
    stack = type(first).__new__(type(first))
    QuantizedLinear.__init__(stack, first.in_features, sum(linear.out_features for linear in linears), None,
                             first.dtype)
    names = ("qweight", "scales", "zeros") if isinstance(first, Int4Linear) else ("qweight", "weight_scale")
    with torch.inference_mode(False):  # plain tensors, whatever mode the step runs in: they become the linears'
        for name in (*names, *(() if first.bias is None else ("bias",))):
            parts = [getattr(linear, name) for linear in linears]
            in_place = _rows_in_place(parts)
            stack.register_buffer(name, torch.cat(parts) if in_place is None else in_place)
            sizes = [_buffer_rows(lin, name) for lin in linears]
            for linear, rows in zip(linears, getattr(stack, name).split(sizes)):
                linear._buffers[name] = rows
    if isinstance(first, Int4Linear):
        stack.group_size, stack.has_zero_points, stack.panels = first.group_size, first.has_zero_points, first.panels
        stack.act_quant, stack.scheme = first.act_quant, first.scheme
    else:
        stack.register_buffer("input_scale", first.input_scale)
        stack.scheme = first.scheme
    stack.take_modes(first)
    return stack


def stackable(linears: list[torch.nn.Module]) -> bool:
    """Whether `stack_linears` can put these linears in one call."""
    first = linears[0]
    if type(first) not in (Int4Linear, Int8Linear) or any(type(linear) is not type(first) for linear in linears):
        return False
    if any(linear.in_features != first.in_features or linear.dtype != first.dtype
           or (linear.bias is None) != (first.bias is None) or linear.use_kernel != first.use_kernel
           or linear.qweight.device != first.qweight.device for linear in linears):
        return False
    if isinstance(first, Int4Linear):
        return all(linear.group_size == first.group_size and linear.panels == first.panels
                   and linear.act_quant == first.act_quant for linear in linears)
    scales = [linear.input_scale for linear in linears]
    return all(linear.act_quant == first.act_quant for linear in linears) and (
        all(scale is None for scale in scales)
        or all(scale is not None and torch.equal(scale, scales[0]) for scale in scales))


def _rows_in_place(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor whose rows `parts` are, one after another in one storage (a stack made before, whose memory was
    moved since: worker/huge_pages.py), as a view: made again without a copy. None where they are not."""
    first = parts[0]
    storage, offset = first.untyped_storage(), first.storage_offset()
    for part in parts:
        if (not part.is_contiguous() or part.untyped_storage().data_ptr() != storage.data_ptr()
                or part.storage_offset() != offset or part.shape[1:] != first.shape[1:] or part.dtype != first.dtype):
            return None
        offset += part.numel()
    shape = (sum(part.shape[0] for part in parts), *first.shape[1:])
    return first.new_empty(0).set_(storage, first.storage_offset(), shape)


def _buffer_rows(linear: QuantizedLinear, name: str) -> int:
    """How many rows of its buffer `name` a linear holds: its output channels, or its panels of 16 (W4A8)."""
    return linear.out_features // q4_panels.PANEL if getattr(linear, "panels", False) and name != "bias" \
        else linear.out_features


def linear_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype a Linear computes in: its weight's, or a quantized linear's model dtype."""
    return module.dtype if isinstance(module, QuantizedLinear) else module.weight.dtype


def linear_device(module: torch.nn.Module) -> torch.device:
    return module.qweight.device if isinstance(module, QuantizedLinear) else module.weight.device
