/* Paged attention's work items for fp32 queries over int8 and fp8 caches: compiled copies of
 * attend_item (wick_attend.h), a file of their own so that the library's build compiles them
 * beside the other copies. */
#include "wick_attend.h"

ATTEND_QUANT_COPIES(ATTEND_DEFINE, f32, 0)
