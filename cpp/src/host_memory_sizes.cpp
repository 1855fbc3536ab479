// The host arena's arithmetic: size classes, byte-size parsing (RAMSTREAM_PIN_BUDGET,
// set_pin_budget) and the machine's physical RAM.
#include "ramstream/host_memory.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <string>

#include "host_memory_internal.h"

namespace ramstream {

using detail::kMaxRequest;
using detail::round_up;

std::size_t host_size_class(std::size_t bytes) {
  if (bytes <= HostArena::kMinBlock) return HostArena::kMinBlock;
  const int lg = 63 - __builtin_clzll(static_cast<unsigned long long>(bytes - 1));
  const std::size_t step = std::max<std::size_t>(HostArena::kAlignment, (std::size_t{1} << lg) / 4);
  return round_up(bytes, step);
}

std::uint64_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 0;
  return static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page);
}

Status parse_byte_size(const std::string& text, std::uint64_t physical, std::uint64_t* out) {
  auto bad = [&](const std::string& why) {
    return Status::invalid("cannot parse '" + text + "' as a byte size (" + why +
                           "); expected bytes with an optional K/M/G/T suffix (powers of 1024, "
                           "e.g. 8G, 512M, 1073741824) or a percentage of RAM (e.g. 60%)");
  };
  std::size_t i = 0, n = text.size();
  while (i < n && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  while (n > i && std::isspace(static_cast<unsigned char>(text[n - 1]))) --n;
  const std::size_t num_begin = i;
  bool dot = false, digit = false;
  for (; i < n; ++i) {
    const char c = text[i];
    if (std::isdigit(static_cast<unsigned char>(c))) {
      digit = true;
    } else if (c == '.' && !dot) {
      dot = true;
    } else {
      break;
    }
  }
  if (!digit) return bad("no number");
  const long double value = std::strtold(text.substr(num_begin, i - num_begin).c_str(), nullptr);
  while (i < n && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  std::string suffix;
  for (; i < n; ++i) suffix += static_cast<char>(std::tolower(static_cast<unsigned char>(text[i])));

  long double bytes = 0;
  if (suffix == "%") {
    if (value > 100) return bad("a percentage must be at most 100");
    if (physical == 0) return bad("physical RAM is unknown, so a percentage cannot be used");
    bytes = static_cast<long double>(physical) * value / 100;
  } else {
    int power = -1;
    static const char* const kNames[][4] = {{"", "b", nullptr, nullptr},
                                            {"k", "kb", "kib", nullptr},
                                            {"m", "mb", "mib", nullptr},
                                            {"g", "gb", "gib", nullptr},
                                            {"t", "tb", "tib", nullptr}};
    for (int p = 0; p < 5 && power < 0; ++p)
      for (int k = 0; k < 4 && kNames[p][k]; ++k)
        if (suffix == kNames[p][k]) power = p;
    if (power < 0) return bad("unknown suffix '" + suffix + "'");
    bytes = value * std::pow(1024.0L, power);
  }
  if (!(bytes < static_cast<long double>(kMaxRequest) * 1024)) return bad("too large");
  *out = static_cast<std::uint64_t>(std::floor(bytes));
  return Status::ok();
}

}  // namespace ramstream
