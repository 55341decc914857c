"""Cosine similarities of the labelled key pairs (``tests/key_pairs.py``), as the model
gave them when ``key_match_threshold`` and ``key_match_strict_threshold`` were chosen.

Computed once with the embedder as first shipped (the graph run as the file has it);
any change to how the model is run must give these back within 1e-4, or the thresholds
no longer mean what they were calibrated to mean.
"""

from __future__ import annotations

SIMILARITY: dict[tuple[str, str], float] = {
    ("birthday", "date_of_birth"): 0.779415,
    ("home_city", "city_of_residence"): 0.852835,
    ("language", "preferred_language"): 0.864462,
    ("job_title", "role"): 0.572222,
    ("favorite_color", "favourite_colour"): 1.000000,
    ("favorite_color", "preferred_color"): 0.867831,
    ("favourite_colour", "preferred_color"): 0.867831,
    ("occupation", "job_title"): 0.714187,
    ("profession", "occupation"): 0.818137,
    ("spouse_name", "wife_name"): 0.907935,
    ("timezone", "time_zone"): 1.000000,
    ("dob", "birth_date"): 0.982251,
    ("email", "email_address"): 0.943095,
    ("phone_number", "mobile"): 1.000000,
    ("employer", "company"): 0.704604,
    ("hometown", "home_town"): 1.000000,
    ("favorite_food", "preferred_food"): 0.866618,
    ("diet", "dietary_preference"): 0.808677,
    ("pet_name", "pets_name"): 1.000000,
    ("nickname", "preferred_name"): 0.758530,
    ("current_city", "city_of_residence"): 0.835698,
    ("favorite_music_genre", "preferred_music_genre"): 0.926675,
    ("allergies", "allergy"): 1.000000,
    ("kids", "children"): 0.884714,
    ("tz", "timezone"): 1.000000,
    ("first_name", "last_name"): 0.860411,
    ("home_city", "work_city"): 0.766434,
    ("dog_name", "cat_name"): 0.752760,
    ("start_date", "end_date"): 0.794338,
    ("min_budget", "max_budget"): 0.940763,
    ("previous_employer", "current_employer"): 0.873669,
    ("favorite_color", "favorite_food"): 0.585496,
    ("favorite_food", "least_favorite_food"): 0.865063,
    ("email", "phone_number"): 0.562543,
    ("birthday", "wedding_anniversary"): 0.543103,
    ("home_address", "work_address"): 0.707935,
    ("mother_name", "father_name"): 0.833686,
    ("job_title", "employer"): 0.651579,
    ("native_language", "learning_language"): 0.709323,
    ("height", "weight"): 0.694321,
    ("home_city", "home_country"): 0.735057,
    ("favorite_sport", "favorite_team"): 0.621800,
    ("wife_name", "daughter_name"): 0.746189,
    ("breakfast", "dinner"): 0.690424,
    ("username", "password"): 0.652381,
    ("favorite_movie", "favorite_book"): 0.756081,
    ("age", "birthday"): 0.685997,
    ("coffee_order", "tea_preference"): 0.506330,
    ("sister_name", "brother_name"): 0.804882,
    ("morning_routine", "evening_routine"): 0.836001,
}
