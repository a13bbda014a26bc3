// Intel AMX tiles as the bf16 prefill kernel uses them (paged_prefill.cpp), or, built with
// -DPAGED_HF_AMX_EMULATE, the same operations in plain C++: the kernel's use of the tiles (layouts, strides,
// pair packing) is then tested on CPUs without AMX, and only these few lines are left to AMX hosts' tests.
//
// Every tile is configured whole (16 rows of 64 bytes). The kernel uses tiles 0-3 as float32 sums, tile 4 as
// the left operand and tiles 5-7 as right operands: `dot(i)` is TDPBF16PS tmm_i += tmm4 . tmm_{5+i}, where
// for each row m and column n, c[m][n] += a[m][2k] b[k][2n] + a[m][2k + 1] b[k][2n + 1] over the 16 pairs k.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(PAGED_HF_AMX_EMULATE) || (defined(__AMX_TILE__) && defined(__AMX_BF16__))
#define PAGED_HF_AMX 1

#ifndef PAGED_HF_AMX_EMULATE
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace paged_hf::amx {

constexpr int kRows = 16, kRowBytes = 64;

#ifdef PAGED_HF_AMX_EMULATE

struct Tiles {
  alignas(64) uint8_t bytes[8][kRows][kRowBytes];
};

inline Tiles &tiles() {
  static thread_local Tiles registers;
  return registers;
}

inline bool enable() { return true; }
inline void configure() {}
inline void release() {}

inline void zero(int t) { std::memset(tiles().bytes[t], 0, sizeof(tiles().bytes[t])); }

inline void load(int t, const void *base, int64_t stride) {
  for (int r = 0; r < kRows; ++r)
    std::memcpy(tiles().bytes[t][r], static_cast<const uint8_t *>(base) + r * stride, kRowBytes);
}

inline void store(int t, void *base, int64_t stride) {
  for (int r = 0; r < kRows; ++r) std::memcpy(static_cast<uint8_t *>(base) + r * stride, tiles().bytes[t][r], kRowBytes);
}

inline float widen(const uint8_t *bf16) {
  uint16_t bits;
  std::memcpy(&bits, bf16, sizeof(bits));
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

inline void dot(int i) {
  Tiles &t = tiles();
  auto &c = t.bytes[i];
  const auto &a = t.bytes[4];
  const auto &b = t.bytes[5 + i];
  for (int m = 0; m < kRows; ++m)
    for (int n = 0; n < kRowBytes / 4; ++n) {
      float sum;
      std::memcpy(&sum, &c[m][4 * n], sizeof(sum));
      for (int k = 0; k < kRowBytes / 4; ++k) {
        sum += widen(&a[m][4 * k]) * widen(&b[k][4 * n]);
        sum += widen(&a[m][4 * k + 2]) * widen(&b[k][4 * n + 2]);
      }
      std::memcpy(&c[m][4 * n], &sum, sizeof(sum));
    }
}

#else

struct alignas(64) Config {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(Config) == 64, "LDTILECFG reads 64 bytes");

// Palette 1, tiles 0-7 each 16 rows of 64 bytes: a constant, so no store the compiler could drop precedes the load.
constexpr Config whole_tiles() {
  Config config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) config.colsb[t] = kRowBytes, config.rows[t] = kRows;
  return config;
}
inline constexpr Config kWholeTiles = whole_tiles();

// Linux gives a process AMX's tile data state only when it asks (arch_prctl); before that the first tile
// instruction faults. Process-wide and idempotent.
inline bool enable() {
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

// Per thread: the tile configuration is thread state.
inline void configure() { _tile_loadconfig(&kWholeTiles); }

inline void release() { _tile_release(); }

// GCC's tile intrinsics name the register by pasting its number into the instruction, so it has to be a literal:
// hence the switches, which fold away where `t` is a constant. Its tile loads do not declare that they read
// memory: the barrier keeps the stores that filled the source before the load.
#define PAGED_HF_TILE_CASES(op) \
  switch (t) {                  \
    case 0: op(0); break;       \
    case 1: op(1); break;       \
    case 2: op(2); break;       \
    case 3: op(3); break;       \
    case 4: op(4); break;       \
    case 5: op(5); break;       \
    case 6: op(6); break;       \
    default: op(7); break;      \
  }

inline void zero(int t) {
#define PAGED_HF_ZERO(n) _tile_zero(n)
  PAGED_HF_TILE_CASES(PAGED_HF_ZERO)
#undef PAGED_HF_ZERO
}

inline void load(int t, const void *base, int64_t stride) {
  asm volatile("" ::: "memory");
#define PAGED_HF_LOAD(n) _tile_loadd(n, base, stride)
  PAGED_HF_TILE_CASES(PAGED_HF_LOAD)
#undef PAGED_HF_LOAD
}

inline void store(int t, void *base, int64_t stride) {
#define PAGED_HF_STORE(n) _tile_stored(n, base, stride)
  PAGED_HF_TILE_CASES(PAGED_HF_STORE)
#undef PAGED_HF_STORE
  asm volatile("" ::: "memory");
}

#undef PAGED_HF_TILE_CASES

inline void dot(int i) {
  switch (i) {
    case 0: _tile_dpbf16ps(0, 4, 5); break;
    case 1: _tile_dpbf16ps(1, 4, 6); break;
    default: _tile_dpbf16ps(2, 4, 7); break;
  }
}

#endif

}  // namespace paged_hf::amx
#endif
