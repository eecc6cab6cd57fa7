// Shared by the kernel tests: the ISA builds every test runs, and the skip of those this CPU (or its OS) cannot run.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "adam/cpu_isa.h"

namespace zeroshard::test_isa {

inline const std::vector<std::string> kIsas = {"scalar", "avx2", "avx512"};

inline bool supported(const std::string& isa) {
  for (CpuIsa s : supported_cpu_isas())
    if (isa == cpu_isa_name(s)) return true;
  return false;
}

}  // namespace zeroshard::test_isa

#define SKIP_IF_UNSUPPORTED(isa)                                                                                     \
  if (!::zeroshard::test_isa::supported(isa)) {                                                                      \
    GTEST_SKIP() << "this CPU (or its OS) cannot run the " << isa << " build; it supports " << zeroshard::cpu_isa(); \
  }
