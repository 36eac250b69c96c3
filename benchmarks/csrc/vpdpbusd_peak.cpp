// The measured peak of vpdpbusd on this machine, for benchmarks/block_paths.py: each thread runs
// 16 independent accumulator chains (enough to hide the latency) of zmm (AVX-512 VNNI) or ymm
// (AVX-VNNI) dot products, timed by each thread's own CPU time (the machines are shared: wall time
// would count other processes' turns). Prints "<isa> <threads> <G int8 op/s>", the sum of the
// threads' rates (2 ops per u8 x s8 multiply-add).
//   g++ -O2 -fopenmp vpdpbusd_peak.cpp -o peak && ./peak avx512vnni 2
#include <immintrin.h>
#include <omp.h>

#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <cstring>

constexpr long kIters = 20'000'000;

__attribute__((target("avx512f,avx512vnni"))) long run512(long iters) {
  __m512i acc[16];
  for (auto& a : acc) a = _mm512_setzero_si512();
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-5);
  asm("" : "+v"(a), "+v"(b));
  for (long i = 0; i < iters; ++i)
#pragma GCC unroll 16
    for (auto& c : acc) c = _mm512_dpbusd_epi32(c, a, b);
  for (auto& c : acc) asm volatile("" ::"v"(c));  // keep the chains
  return iters * 16 * 64;                          // multiply-adds done
}

__attribute__((target("avx2,avxvnni"))) long run256(long iters) {
  __m256i acc[12];
  for (auto& a : acc) a = _mm256_setzero_si256();
  __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-5);
  asm("" : "+x"(a), "+x"(b));
  for (long i = 0; i < iters; ++i)
#pragma GCC unroll 12
    for (auto& c : acc) c = _mm256_dpbusd_avx_epi32(c, a, b);
  for (auto& c : acc) asm volatile("" ::"x"(c));
  return iters * 12 * 32;
}

int main(int argc, char** argv) {
  const bool zmm = argc > 1 && std::strcmp(argv[1], "avx512vnni") == 0;
  const int threads = argc > 2 ? std::atoi(argv[2]) : 1;
  double rate = 0;  // multiply-adds per CPU second, summed over threads
#pragma omp parallel for num_threads(threads) reduction(+ : rate)
  for (int t = 0; t < threads; ++t) {
    timespec a{}, b{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
    const long macs = zmm ? run512(kIters / 4) : run256(kIters / 4);
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
    rate += macs / ((b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec));
  }
  std::printf("%s %d %.1f\n", zmm ? "avx512vnni" : "avxvnni", threads, 2.0 * rate / 1e9);
  return 0;
}
