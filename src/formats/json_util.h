/* json_util.h — small helpers shared by the JSON readers (config.c,
 * safetensors.c). */
#ifndef CF_JSON_UTIL_H
#define CF_JSON_UTIL_H

#include <cjson/cJSON.h>

/* A short description of a JSON value for error messages. */
static inline const char *cf_json_kind(const cJSON *v) {
    if (cJSON_IsString(v)) return "a string";
    if (cJSON_IsBool(v)) return "a boolean";
    if (cJSON_IsNull(v)) return "null";
    if (cJSON_IsArray(v)) return "an array";
    if (cJSON_IsObject(v)) return "an object";
    if (cJSON_IsNumber(v)) return "a number";
    return "an invalid value";
}

#endif
