#include "adam/cpu_isa.h"

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define ZS_X86 1
#endif

namespace zeroshard {
namespace {

constexpr const char* kEnvVar = "ZEROSHARD_CPU_ISA";

#ifdef ZS_X86
// XCR0: which register states the OS saves on context switch. Executing AVX code when the OS does not save YMM/ZMM
// state corrupts registers silently, so CPUID alone is not enough.
uint64_t read_xcr0() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

std::vector<CpuIsa> detect() {
  std::vector<CpuIsa> isas{CpuIsa::kScalar};
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return isas;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28), fma = c & (1u << 12), f16c = c & (1u << 29);
  if (!osxsave || !avx) return isas;
  const uint64_t xcr0 = read_xcr0();
  const bool ymm_state = (xcr0 & 0x6) == 0x6;    // SSE + AVX
  const bool zmm_state = (xcr0 & 0xE6) == 0xE6;  // + opmask, ZMM_Hi256, Hi16_ZMM
  if (__get_cpuid_max(0, nullptr) < 7) return isas;
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx2 = b & (1u << 5);
  const bool avx512 = (b & (1u << 16)) && (b & (1u << 17)) && (b & (1u << 30)) && (b & (1u << 31));  // F DQ BW VL
  if (!(ymm_state && avx2 && fma && f16c)) return isas;
  isas.push_back(CpuIsa::kAvx2);
  if (zmm_state && avx512) isas.push_back(CpuIsa::kAvx512);
  return isas;
}

std::string detect_vendor() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return "";
  const unsigned regs[3] = {b, d, c};  // the 12 bytes in this order
  return std::string(reinterpret_cast<const char*>(regs), 12);
}
#else
std::vector<CpuIsa> detect() { return {CpuIsa::kScalar}; }
std::string detect_vendor() { return ""; }
#endif

std::string supported_list();

// `source` says where the name came from (argument or environment variable), so the error can say what to change.
CpuIsa parse_from(std::string_view name, std::string_view source) {
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (name == cpu_isa_name(isa)) return isa;
  }
  TORCH_CHECK_VALUE(false, source, "='", name, "' is not a CPU ISA name: valid names are scalar, avx2, avx512, and ",
                    "this CPU supports ", supported_list(), ". Use one of those, or unset ", kEnvVar,
                    " to pick the best one automatically.");
}

std::string supported_list() {
  std::string s;
  for (CpuIsa isa : supported_cpu_isas()) s += (s.empty() ? "" : ", ") + std::string(cpu_isa_name(isa));
  return s;
}

}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kScalar:
      break;
  }
  return "scalar";
}

CpuIsa parse_cpu_isa(std::string_view name) { return parse_from(name, "isa"); }

const std::vector<CpuIsa>& supported_cpu_isas() {
  static const std::vector<CpuIsa> isas = detect();  // thread-safe static init
  return isas;
}

CpuIsa resolve_cpu_isa(std::optional<std::string_view> requested) {
  std::string_view source = "isa argument";
  if (!requested) {
    const char* env = std::getenv(kEnvVar);
    if (env == nullptr || *env == '\0') return supported_cpu_isas().back();
    requested = env;
    source = kEnvVar;
  }
  const CpuIsa isa = parse_from(*requested, source);
  for (CpuIsa s : supported_cpu_isas()) {
    if (s == isa) return isa;
  }
  TORCH_CHECK_VALUE(false, source, "='", *requested, "' asks for an ISA this CPU (or its OS) cannot run; this CPU ",
                    "supports ", supported_list(), ". Use one of those, or unset ", kEnvVar,
                    " to pick the best one automatically.");
}

std::string cpu_isa() { return cpu_isa_name(resolve_cpu_isa()); }

const std::string& cpu_vendor() {
  static const std::string vendor = detect_vendor();
  return vendor;
}

}  // namespace zeroshard
