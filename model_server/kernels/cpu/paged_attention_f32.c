/* Paged attention's work items for fp32 queries over fp32 caches and over bf16 caches:
 * compiled copies of attend_item (wick_attend.h), a file of their own so that the library's
 * build compiles them beside the other copies. */
#include "wick_attend.h"

ATTEND_F32_COPIES(ATTEND_DEFINE)
