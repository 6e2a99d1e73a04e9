/* Which instruction sets this build compiled in (-march=native on the building CPU). cpu.py
 * loads the library only when the running CPU reports every one of them. */
#include "common.h"

enum {
    FEATURE_AVX512F = 1,
    FEATURE_AVX512BW = 2,
    FEATURE_AVX512BF16 = 4,
    FEATURE_AVX512VNNI = 8,
    FEATURE_AMX_TILE = 16,
    FEATURE_AMX_BF16 = 32,
    FEATURE_AVX2 = 64,
    FEATURE_FMA = 128,
    FEATURE_F16C = 256,
};

int portico_compiled_features(void) {
    int f = 0;
#ifdef __AVX512F__
    f |= FEATURE_AVX512F;
#endif
#ifdef __AVX512BW__
    f |= FEATURE_AVX512BW;
#endif
#ifdef __AVX512BF16__
    f |= FEATURE_AVX512BF16;
#endif
#ifdef __AVX512VNNI__
    f |= FEATURE_AVX512VNNI;
#endif
#ifdef __AMX_TILE__
    f |= FEATURE_AMX_TILE;
#endif
#ifdef __AMX_BF16__
    f |= FEATURE_AMX_BF16;
#endif
#ifdef __AVX2__
    f |= FEATURE_AVX2;
#endif
#ifdef __FMA__
    f |= FEATURE_FMA;
#endif
#ifdef __F16C__
    f |= FEATURE_F16C;
#endif
    return f;
}
