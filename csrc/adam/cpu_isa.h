// Run-time choice of the instruction set the fused CPU Adam runs with. One binary ships all three kernel builds;
// the best one this CPU *and* its OS support is used unless ZEROSHARD_CPU_ISA forces another.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace zeroshard {

enum class CpuIsa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// "scalar", "avx2", "avx512".
const char* cpu_isa_name(CpuIsa isa);

// Parses a name as above; throws c10::ValueError naming the value and the valid names if it is unknown.
CpuIsa parse_cpu_isa(std::string_view name);

// The ISAs this machine can run, in ascending order (always starts with scalar). Detected once via CPUID and XGETBV:
//   avx2   = AVX2 + FMA + F16C, and the OS saves YMM state;
//   avx512 = AVX-512 F + BW + VL + DQ, plus the avx2 set, and the OS saves ZMM state.
const std::vector<CpuIsa>& supported_cpu_isas();

// Resolves the ISA for one call: `requested` if given, else $ZEROSHARD_CPU_ISA if set and non-empty, else the best
// supported one. Throws c10::ValueError naming the value, this CPU's ISAs and the fix if the value is unknown or
// names an ISA this machine cannot run.
CpuIsa resolve_cpu_isa(std::optional<std::string_view> requested = std::nullopt);

// Name of the ISA a call without an override would use now (honours ZEROSHARD_CPU_ISA).
std::string cpu_isa();

// The CPUID vendor string ("GenuineIntel", "AuthenticAMD", ...; empty off x86).
const std::string& cpu_vendor();

}  // namespace zeroshard
