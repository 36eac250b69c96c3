// Two facts about AMX on the machine it runs on (README, "Against llama.cpp's server", session 25),
// measured by a standalone program so that they can be checked again on another Xeon:
//   1. rates: tdpbssd with 4 independent C tiles (K = 64 and K = 32, the block size of GGUF's
//      formats), and one block's whole sequence as a block kernel needs it (load A, load B, zero C,
//      product, store C), alone and beside the zmm float step that combines each block's 16 x 16
//      sums (load, convert, scale product, fma for 16 rows);
//   2. bits: whether tdpbf16ps's sums equal a chain of vdpbf16ps steps over the same pairs (in pair
//      order, in reverse order) or scalar FMAs low element then high, on random bf16 inputs.
// Run it only where AMX runs (engine.kernels.amx_probe says `runs`): an AMX instruction traps
// elsewhere.
//   g++ -O2 -march=sapphirerapids amx_facts.cpp -o amx_facts && ./amx_facts
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

double now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

constexpr int kBlocks = 18;  // K = 576, SmolLM2's hidden size
constexpr int kK = kBlocks * 32;
alignas(64) int8_t A[16 * kK];
alignas(64) uint8_t B[kBlocks * 512];
alignas(64) int32_t S[2][256];
float dx[16 * kBlocks], dw[kBlocks * 16];

__attribute__((noinline)) void combine(const int32_t* s, int b, __m512* acc) {
  const __m512 w = _mm512_loadu_ps(dw + b * 16);
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i)
    acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(w, _mm512_set1_ps(dx[i * kBlocks + b])),
                             _mm512_cvtepi32_ps(_mm512_load_si512(s + 16 * i)), acc[i]);
}

void rates() {
  TileConfig c;
  for (int t = 0; t < 4; ++t) c.colsb[t] = 64, c.rows[t] = 16;  // C
  for (int t = 4; t < 6; ++t) c.colsb[t] = 64, c.rows[t] = 16;  // A, K = 64
  for (int t = 6; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;  // B, K = 64
  _tile_loadconfig(&c);
  _tile_loadd(4, A, 64);
  _tile_loadd(5, A, 64);
  _tile_loadd(6, B, 64);
  _tile_loadd(7, B, 64);
  const long n = 5'000'000;
  double t = now();
  for (long i = 0; i < n; ++i) {
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  }
  t = now() - t;
  std::printf("tdpbssd 16x16x64, 4 C tiles: %.2f ns each, %.0f G int8 op/s per core\n",
              t / (4.0 * n) * 1e9, 4.0 * n * 16 * 16 * 64 * 2 / t / 1e9);
  _tile_release();
  for (int t2 = 4; t2 < 6; ++t2) c.colsb[t2] = 32;  // A: K = 32
  for (int t2 = 6; t2 < 8; ++t2) c.rows[t2] = 8;    // B: K = 32
  _tile_loadconfig(&c);
  __m512 acc[16];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int mode = 1; mode <= 3; ++mode) {
    const long reps = 200'000;
    t = now();
    for (long r = 0; r < reps; ++r)
      for (int b = 0; b < kBlocks; b += 2) {
        if (mode & 1) {
          _tile_loadd(4, A + b * 32, kK);
          _tile_loadd(6, B + b * 512, 64);
          _tile_zero(0);
          _tile_dpbssd(0, 4, 6);
          _tile_stored(0, S[0], 64);
          _tile_loadd(5, A + b * 32 + 32, kK);
          _tile_loadd(7, B + b * 512 + 512, 64);
          _tile_zero(1);
          _tile_dpbssd(1, 5, 7);
          _tile_stored(1, S[1], 64);
        }
        if (mode & 2) combine(S[0], b, acc), combine(S[1], b + 1, acc);
      }
    t = now() - t;
    static const char* what[] = {"", "tiles (load A, B, zero, product, store)", "float step",
                                 "both"};
    std::printf("per 16x16x32 block, %s: %.2f ns\n", what[mode], t / (reps * kBlocks) * 1e9);
  }
  float sink = 0;
  for (auto& a : acc) sink += _mm512_reduce_add_ps(a);
  if (sink == 12345.f) std::printf(" ");
  _tile_release();
}

uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void bits() {
  TileConfig c;
  for (int t = 0; t < 3; ++t) c.colsb[t] = 64, c.rows[t] = 16;  // C, A (32 bf16 a row), B
  _tile_loadconfig(&c);
  uint32_t state = 12345;
  auto rnd = [&] {
    state = state * 1664525u + 1013904223u;
    return static_cast<float>(static_cast<int>(state >> 8) % 20001 - 10000) / 1000.f *
           std::ldexp(1.f, static_cast<int>((state >> 3) % 24) - 12);
  };
  alignas(64) uint16_t a[16 * 32], b[16 * 32];
  alignas(64) float cz[256], init[256];
  long chain = 0, reverse = 0, scalar = 0, total = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    for (int i = 0; i < 16 * 32; ++i) a[i] = to_bf16(rnd()), b[i] = to_bf16(rnd());
    for (float& v : init) v = trial % 2 ? rnd() : 0.f;
    std::memcpy(cz, init, sizeof cz);
    _tile_loadd(0, cz, 64);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b, 64);
    _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, cz, 64);
    for (int m = 0; m < 16; ++m) {
      __m512 up = _mm512_loadu_ps(init + 16 * m), down = up;
      for (int k = 0; k < 16; ++k) {
        int32_t pa, pd;
        std::memcpy(&pa, &a[m * 32 + 2 * k], 4);
        std::memcpy(&pd, &a[m * 32 + 2 * (15 - k)], 4);
        up = _mm512_dpbf16_ps(up, (__m512bh)_mm512_set1_epi32(pa),
                              (__m512bh)_mm512_loadu_si512(&b[k * 32]));
        down = _mm512_dpbf16_ps(down, (__m512bh)_mm512_set1_epi32(pd),
                                (__m512bh)_mm512_loadu_si512(&b[(15 - k) * 32]));
      }
      float u[16], d[16];
      _mm512_storeu_ps(u, up);
      _mm512_storeu_ps(d, down);
      for (int n = 0; n < 16; ++n) {
        float s = init[16 * m + n];
        for (int k = 0; k < 16; ++k)
          for (int e = 0; e < 2; ++e)
            s = std::fma(from_bf16(a[m * 32 + 2 * k + e]), from_bf16(b[k * 32 + 2 * n + e]), s);
        const float* got = &cz[16 * m + n];
        ++total;
        chain += std::memcmp(&u[n], got, 4) == 0;
        reverse += std::memcmp(&d[n], got, 4) == 0;
        scalar += std::memcmp(&s, got, 4) == 0;
      }
    }
  }
  std::printf("tdpbf16ps outputs bitwise equal to: a vdpbf16ps chain in pair order %ld of %ld, in "
              "reverse order %ld, scalar fma (low, high) %ld\n",
              chain, total, reverse, scalar);
  _tile_release();
}

}  // namespace

int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    std::perror("arch_prctl(ARCH_REQ_XCOMP_PERM)");
    return 1;
  }
  rates();
  bits();
  return 0;
}
