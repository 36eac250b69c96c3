// The bf16 attention kernels' path (attention_bf16.h): the probe that lets the hardware kernels run
// (in a child process: flags are not proof that an instruction runs, nor that it rounds as its
// definition says), and the ops that report and switch the path.
#include <torch/library.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention_bf16.h"
#include "child_probe.h"

namespace kvserve_attention {

#ifdef KV_HAVE_AVX2_ATTENTION
namespace {

// Random decode items (odd and even lengths, 1 to 3 heads, tails after the runs of 8) through both
// compilations; true when the bits agree.
bool same_bits() {
  constexpr int64_t d = 64, heads = 3;
  std::mt19937 gen(12345);
  std::normal_distribution<float> normal(0.f, 1.f);
  bool same = true;
  for (int64_t len : {45, 40, 3}) {
    std::vector<bf16> kv(2 * len * d);
    for (auto& x : kv) x = bf16(normal(gen));
    std::vector<float> q(heads * d);
    for (auto& x : q) x = normal(gen);
    std::vector<const bf16*> kp(len), vp(len + 1, zero_row());
    for (int64_t t = 0; t < len; ++t) kp[t] = kv.data() + t * d, vp[t] = kv.data() + (len + t) * d;
    for (int64_t count = 1; count <= heads; ++count) {
      std::vector<uint16_t> qb(heads * d);
      std::vector<float> s1(count * len), s2(count * len), o1(count * d), o2(count * d);
      FlushDenormals flush;
      bf16_emu::round_query(q.data(), 0.125f, count * d, qb.data());
      bf16_emu::attend_item(qb.data(), kp.data(), vp.data(), len, count, d, 0.f, s1.data(),
                            o1.data());
      std::vector<uint16_t> qh(heads * d);
      bf16_hw::round_query(q.data(), 0.125f, count * d, qh.data());
      bf16_hw::attend_item(qh.data(), kp.data(), vp.data(), len, count, d, 0.f, s2.data(),
                           o2.data());
      same = same && qb == qh && std::memcmp(o1.data(), o2.data(), o1.size() * sizeof(float)) == 0;
    }
  }
  return same;
}

}  // namespace

std::string bf16_hw_probe() {
  static const std::string result = []() -> std::string {
    if (!__builtin_cpu_supports("avx512bf16")) return "the CPU lacks avx512_bf16";
    if (!__builtin_cpu_supports("avx512vl")) return "the CPU lacks avx512vl";
    if (!cpu_has_avx2_fma()) return "the CPU lacks avx2, fma or f16c";
    return kvprobe::in_child(same_bits,
                             "its probe gave results that differ from the emulated kernels");
  }();
  return result;
}
#endif

namespace {

// Sets the path (0: emulated, 1: the hardware one where it runs); returns the one it replaces.
int64_t attention_bf16_select(int64_t mode) {
  TORCH_CHECK(mode == 0 || mode == 1, "attention_bf16_select: mode must be 0 or 1, not ", mode);
#ifdef KV_HAVE_AVX2_ATTENTION
  return bf16_mode.exchange(static_cast<int>(mode));
#else
  return mode;
#endif
}

// Which kernels attention over a bfloat16 cache runs, and why.
std::string attention_bf16_path() {
#ifdef KV_HAVE_AVX2_ATTENTION
  if (!cpu_has_avx2_fma()) return "portable (no AVX2 + FMA: float32 arithmetic)";
  const std::string why = bf16_hw_probe();
  if (bf16_use_hw()) return "avx512bf16 (vdpbf16ps)";
  if (why.empty()) return "emulated (AVX2 + FMA; avx512bf16 runs, emulation forced)";
  return "emulated (AVX2 + FMA; avx512bf16 not used: " + why + ")";
#else
  return "portable (float32 arithmetic)";
#endif
}

// "" when the hardware kernels run here (whichever is selected), else why not.
std::string attention_bf16_probe() {
#ifdef KV_HAVE_AVX2_ATTENTION
  return bf16_hw_probe();
#else
  return "not an x86-64 build";
#endif
}

}  // namespace
}  // namespace kvserve_attention

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("attention_bf16_select", &kvserve_attention::attention_bf16_select);
  m.def("attention_bf16_path", &kvserve_attention::attention_bf16_path);
  m.def("attention_bf16_probe", &kvserve_attention::attention_bf16_probe);
}
