// AMX tile configuration (palette 1), shared by the AMX paths. A configuration must live in static memory: gcc 12
// drops the stores of one on the stack before ldtilecfg (it does not see the instruction read them).
#pragma once

#include <cstdint>

namespace bp {

struct TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "AMX tile configuration is 64 bytes");

}  // namespace bp
