// Which block-kernel path runs (block_matmul.h): each ISA path is proven in a child process (a
// tiny matmul, compared bit for bit with the portable loops) before it is trusted, since cpuid
// flags are not proof that an instruction runs (machines advertise AMX that traps). The fastest
// path that runs is taken, unless KVSERVE_BLOCK_KERNELS names one; ops report and switch it.
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "block_matmul.h"
#include "child_probe.h"

namespace {

using kvblock::PathFns;

// Fastest first (measured with benchmarks/block_paths.py); portable last, always runs.
const std::vector<PathFns>& paths() {
  static const std::vector<PathFns> all = {
#if defined(__x86_64__) && defined(__GNUC__)
      {"avx512vnni", kvblock::quantize_row_avx2, kvblock::q4_groups_avx512vnni,
       kvblock::q8_groups_avx512vnni, true, true, kvblock::kq_groups_avx512vnni,
       kvblock::q5_groups_avx512vnni},
      {"avxvnni", kvblock::quantize_row_avx2, kvblock::q4_groups_avxvnni,
       kvblock::q8_groups_avxvnni, true, false, kvblock::kq_groups_avxvnni,
       kvblock::q5_groups_avxvnni},
      {"avx2", kvblock::quantize_row_avx2, kvblock::q4_groups_avx2, kvblock::q8_groups_avx2,
       false, false, kvblock::kq_groups_avx2, kvblock::q5_groups_avx2},
#endif
      {"portable", kvblock::quantize_row_ref, kvblock::q4_groups_ref, kvblock::q8_groups_ref,
       false, false, kvblock::kq_groups_ref, kvblock::q5_groups_ref},
  };
  return all;
}

// The cpuid flags a path needs ("" when it has all of them, else the first missing one).
std::string missing_flag(const std::string& name) {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (name == "portable") return "";
  if (!avx2) return "avx2/fma/f16c";
  if (name == "avxvnni" && !__builtin_cpu_supports("avxvnni")) return "avx_vnni";
  if (name == "avx512vnni") {
    if (!__builtin_cpu_supports("avx512f")) return "avx512f";
    if (!__builtin_cpu_supports("avx512bw")) return "avx512bw";
    if (!__builtin_cpu_supports("avx512vl")) return "avx512vl";
    if (!__builtin_cpu_supports("avx512vnni")) return "avx512_vnni";
  }
  return "";
#else
  return name == "portable" ? "" : "x86-64";
#endif
}

// A small matmul of every kind and shape case the kernels have (several row tiles, an odd number of
// column groups, negative and extreme values), its inputs made before the fork: the child only runs
// kernels, which neither allocate nor lock.
struct ProbeCase {
  static constexpr int64_t M = 11, K = 96, KB = 3, G = 3, N = 24;
  std::vector<int8_t> q = std::vector<int8_t>(M * K);
  std::vector<uint8_t> u = std::vector<uint8_t>(M * K);
  std::vector<float> d = std::vector<float>(M * KB), s = std::vector<float>(M * KB);
  std::vector<uint8_t> w4 = std::vector<uint8_t>(G * KB * 128);
  std::vector<int8_t> w8 = std::vector<int8_t>(G * KB * 256);
  std::vector<c10::Half> wd = std::vector<c10::Half>(G * KB * 8), wm = wd;
  std::vector<float> expect4 = std::vector<float>(M * N), expect8 = expect4, expect40 = expect4;
  std::vector<uint8_t> pk4 = u, pk8 = u;  // tile-packed q (for q4) and u (for q8)
  std::vector<float> pd = d, ps = s;
  std::vector<int32_t> n8 = std::vector<int32_t>(M * KB), pn8 = n8;  // for Q4_0

  ProbeCase() {
    uint32_t state = 12345;
    auto next = [&] { return state = state * 1664525u + 1013904223u, state >> 8; };
    std::vector<float> x(M * K);
    for (auto& v : x) v = static_cast<float>(static_cast<int>(next() % 2001) - 1000) / 37.f;
    for (int64_t m = 0; m < M; ++m)
      kvblock::quantize_row_ref(&x[m * K], K, &q[m * K], &d[m * KB], &s[m * KB]);
    for (int64_t k = 0; k < M * K; ++k) u[k] = static_cast<uint8_t>(q[k]) ^ 0x80;
    const auto* bytes = reinterpret_cast<const uint8_t*>(q.data());
    for (int64_t m = 0; m < M; ++m) kvblock::offset_sums(&q[m * K], K, 8, &n8[m * KB]);
    for (int64_t m = 0; m < M; ++m) {
      kvblock::pack_row(m, M, K, bytes + m * K, &d[m * KB], &s[m * KB], pk4.data(), pd.data(),
                        ps.data(), &n8[m * KB], pn8.data());
      kvblock::pack_row(m, M, K, &u[m * K], &d[m * KB], &s[m * KB], pk8.data(), pd.data(),
                        ps.data());
    }
    for (auto& v : w4) v = static_cast<uint8_t>(next());
    for (size_t i = 0; i < w8.size(); ++i) w8[i] = static_cast<int8_t>(i % 7 == 0 ? -128 : next());
    for (size_t i = 0; i < wd.size(); ++i) {
      wd[i] = static_cast<float>(next() % 1000) / 3000.f;
      wm[i] = -static_cast<float>(next() % 1000) / 5000.f;
    }
    run(paths().back(), expect4.data(), expect8.data(), expect40.data());
  }

  void run(const PathFns& p, float* out4, float* out8, float* out40) const {
    kvblock::QuantRows x4{q.data(), u.data(), d.data(), s.data(), K, KB,
                          pk4.data(), pd.data(), ps.data()};
    x4.n8 = n8.data(), x4.pn8 = pn8.data();  // read by the Q4_0 weight only
    const kvblock::QuantRows x8{q.data(), u.data(), d.data(), s.data(), K, KB,
                                pk8.data(), pd.data(), ps.data()};
    const kvblock::BlockWeight b4{w4.data(), nullptr, wd.data(), wm.data()};
    const kvblock::BlockWeight b8{nullptr, w8.data(), wd.data(), nullptr};
    const kvblock::BlockWeight b40{w4.data(), nullptr, wd.data(), nullptr};  // Q4_0: no m
    p.q4(b4, x4, 0, M, 0, G, N, out4);
    p.q8(b8, x8, 0, M, 0, G, N, out8);
    p.q4(b40, x4, 0, M, 0, G, N, out40);
  }
};

// The K-quant kernels' probe: two super-blocks, several row tiles, three column groups, each of
// Q4_K, Q5_K and Q6_K (random bytes are valid values of every plane and scale).
struct KProbeCase {
  static constexpr int64_t M = 11, K = 512, KB = 16, G = 3, N = 24;
  std::vector<int8_t> q = std::vector<int8_t>(M * K);
  std::vector<float> d = std::vector<float>(M * KB), s = std::vector<float>(M * KB);
  std::vector<int32_t> h = std::vector<int32_t>(M * 2 * KB);
  std::vector<uint8_t> qs = std::vector<uint8_t>(G * KB * 6 * 32), sc = std::vector<uint8_t>(G * KB * 16);
  std::vector<c10::Half> dm = std::vector<c10::Half>(G * (KB / 8) * 16);
  std::vector<float> expect = std::vector<float>(3 * M * N);

  KProbeCase() {
    uint32_t state = 777;
    auto next = [&] { return state = state * 1664525u + 1013904223u, state >> 8; };
    std::vector<float> x(M * K);
    for (auto& v : x) v = static_cast<float>(static_cast<int>(next() % 2001) - 1000) / 29.f;
    for (int64_t m = 0; m < M; ++m)
      kvblock::quantize_row_ref(&x[m * K], K, &q[m * K], &d[m * KB], &s[m * KB]);
    for (int64_t i = 0; i < M * 2 * KB; ++i)
      for (int k = 0; k < 16; ++k) h[i] += q[i * 16 + k];
    for (auto& v : qs) v = static_cast<uint8_t>(next());
    for (auto& v : sc) v = static_cast<uint8_t>(next());  // Q6_K reads them as int8
    for (auto& v : dm) v = static_cast<float>(next() % 1000) / 30000.f;
    run(paths().back(), expect.data());
  }

  void run(const PathFns& p, float* out) const {
    const kvblock::QuantRows x{q.data(), nullptr, d.data(), s.data(), K, KB,
                               nullptr, nullptr, nullptr, h.data()};
    for (int bits = 4; bits <= 6; ++bits) {
      const kvblock::KWeight w{qs.data(), sc.data(), dm.data(), bits};
      p.kq(w, x, 0, M, 0, G, N, out + (bits - 4) * M * N);
    }
  }
};

// The Q5 kernels' probe (block_q5.cpp): Q5_1 and Q5_0 (m derived), several row tiles (8-row zmm
// tiles and a remainder), three column groups (a lone last one), random bytes in every plane.
struct Q5ProbeCase {
  static constexpr int64_t M = 11, K = 96, KB = 3, G = 3, N = 24;
  std::vector<int8_t> q = std::vector<int8_t>(M * K);
  std::vector<float> d = std::vector<float>(M * KB), s = std::vector<float>(M * KB);
  std::vector<uint8_t> qs = std::vector<uint8_t>(G * KB * 160);
  std::vector<c10::Half> wd = std::vector<c10::Half>(G * KB * 8), wm = wd;
  std::vector<float> expect = std::vector<float>(2 * M * N);
  std::vector<int32_t> n16 = std::vector<int32_t>(M * KB);  // for Q5_0

  Q5ProbeCase() {
    uint32_t state = 4242;
    auto next = [&] { return state = state * 1664525u + 1013904223u, state >> 8; };
    std::vector<float> x(M * K);
    for (auto& v : x) v = static_cast<float>(static_cast<int>(next() % 2001) - 1000) / 31.f;
    for (int64_t m = 0; m < M; ++m) {
      kvblock::quantize_row_ref(&x[m * K], K, &q[m * K], &d[m * KB], &s[m * KB]);
      kvblock::offset_sums(&q[m * K], K, 16, &n16[m * KB]);
    }
    for (auto& v : qs) v = static_cast<uint8_t>(next());
    for (size_t i = 0; i < wd.size(); ++i) {
      wd[i] = static_cast<float>(next() % 1000) / 3000.f;
      wm[i] = -static_cast<float>(next() % 1000) / 5000.f;
    }
    run(paths().back(), expect.data());
  }

  void run(const PathFns& p, float* out) const {
    kvblock::QuantRows x{q.data(), nullptr, d.data(), s.data(), K, KB};
    x.n16 = n16.data();  // read by the Q5_0 weight only
    p.q5(kvblock::Q5Weight{qs.data(), wd.data(), wm.data()}, x, 0, M, 0, G, N, out);
    p.q5(kvblock::Q5Weight{qs.data(), wd.data(), nullptr}, x, 0, M, 0, G, N, out + M * N);
  }
};

// "" when the path runs here and gives the portable loops' bits, else why not.
std::string probe(const PathFns& p) {
  const std::string name = p.name;
  if (name == "portable") return "";
  const std::string flag = missing_flag(name);
  if (!flag.empty()) return "the CPU lacks " + flag;
  static const ProbeCase test;
  static const KProbeCase ktest;
  static const Q5ProbeCase q5test;
  std::vector<float> got4(test.expect4.size()), got8(test.expect8.size()), got40(got4.size());
  std::vector<float> gotk(ktest.expect.size()), got5(q5test.expect.size());
  return kvprobe::in_child(
      [&] {
        test.run(p, got4.data(), got8.data(), got40.data());
        ktest.run(p, gotk.data());
        q5test.run(p, got5.data());
        return std::memcmp(got4.data(), test.expect4.data(), got4.size() * sizeof(float)) == 0 &&
               std::memcmp(got40.data(), test.expect40.data(), got40.size() * sizeof(float)) == 0 &&
               std::memcmp(got8.data(), test.expect8.data(), got8.size() * sizeof(float)) == 0 &&
               std::memcmp(gotk.data(), ktest.expect.data(), gotk.size() * sizeof(float)) == 0 &&
               std::memcmp(got5.data(), q5test.expect.data(), got5.size() * sizeof(float)) == 0;
      },
      "its probe gave results that differ from the portable loops");
}

const std::string& probe_result(size_t i) {
  static const std::vector<std::string> results = [] {
    std::vector<std::string> r;
    for (const auto& p : paths()) r.push_back(probe(p));
    return r;
  }();
  return results.at(i);
}

int index_of(const std::string& name) {
  for (size_t i = 0; i < paths().size(); ++i)
    if (name == paths()[i].name) return static_cast<int>(i);
  return -1;
}

std::string names() {
  std::string all = "auto";
  for (const auto& p : paths()) all += std::string(", ") + p.name;
  return all;
}

std::string probes_summary() {
  std::string out;
  for (size_t i = 0; i < paths().size(); ++i) {
    const std::string& why = probe_result(i);
    if (!out.empty()) out += "; ";
    out += std::string(paths()[i].name) + (why.empty() ? " runs" : " not used: " + why);
  }
  return out;
}

int fastest_that_runs() {
  for (size_t i = 0; i < paths().size(); ++i)
    if (probe_result(i).empty()) return static_cast<int>(i);
  return static_cast<int>(paths().size()) - 1;
}

std::mutex g_mutex;
std::atomic<int> g_path{-1};
std::string g_reason;  // guarded by g_mutex

// Sets the path for `name` ("auto": the fastest that runs); "" on success, else why not.
std::string choose(const std::string& name, const std::string& how) {
  if (name.empty() || name == "auto") {
    const int i = fastest_that_runs();
    std::lock_guard<std::mutex> lock(g_mutex);
    g_reason = how + "auto: the fastest path that runs here (" + probes_summary() + ")";
    g_path.store(i);
    return "";
  }
  const int i = index_of(name);
  if (i < 0) return "unknown block-kernel path '" + name + "'; choose from " + names();
  if (!probe_result(i).empty()) return name + " cannot run here: " + probe_result(i);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_reason = how + name + " forced (" + probes_summary() + ")";
  g_path.store(i);
  return "";
}

int current_index() {
  int i = g_path.load();
  if (i >= 0) return i;
  static std::once_flag once;
  std::call_once(once, [] {
    const char* env = std::getenv("KVSERVE_BLOCK_KERNELS");
    const std::string name = env != nullptr ? env : "";
    const std::string why = choose(name, env != nullptr ? "KVSERVE_BLOCK_KERNELS=" + name + ": " : "");
    if (!why.empty()) choose("auto", "KVSERVE_BLOCK_KERNELS ignored (" + why + "); ");
  });
  return g_path.load();
}

std::string block_kernels_path() { return paths()[current_index()].name; }

std::string block_kernels_reason() {
  current_index();
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_reason;
}

std::string block_kernels_probe(const std::string& name) {
  const int i = index_of(name);
  TORCH_CHECK(i >= 0, "unknown block-kernel path '", name, "'; choose from ", names());
  return probe_result(i);
}

std::string block_kernels_select(const std::string& name) {
  current_index();
  const std::string why = choose(name, "block_kernels_select: ");
  TORCH_CHECK(why.empty(), why);
  return block_kernels_path();
}

bool block_kernels_vectorized() { return block_kernels_path() != std::string("portable"); }

}  // namespace

const kvblock::PathFns& kvblock::current_path() { return paths()[current_index()]; }

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("block_kernels_vectorized", &block_kernels_vectorized);
  m.def("block_kernels_path", &block_kernels_path);
  m.def("block_kernels_reason", &block_kernels_reason);
  m.def("block_kernels_probe", &block_kernels_probe);
  m.def("block_kernels_select", &block_kernels_select);
}
